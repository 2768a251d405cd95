//! Shape and value checks shared by every operator, and the gather/scatter
//! between FLA's time-major `[B, T, heads, D]` tensors and the per-head
//! `[L, D]` blocks the engines work on.

use ndarray::{s, Array2, Array4, ArrayBase, ArrayD, ArrayView2, ArrayView4, Data, Ix4};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::fast::par::PAR_FILL;
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

/// [`expect_shape`], then [`check_finite`]: `x` is `expected` (axes named by
/// `dims`) and holds no NaN or ±Inf.
pub(crate) fn expect_finite<T: Scalar>(
    tensor: &str,
    dims: &str,
    expected: &[usize],
    x: &ArrayD<T>,
) -> Result<()> {
    expect_shape(tensor, dims, expected, x.shape())?;
    check_finite(tensor, x)
}

/// Checks the rank only, returning the shape.
pub(crate) fn expect_rank<'a, T>(
    tensor: &str,
    dims: &str,
    x: &'a ArrayD<T>,
) -> Result<&'a [usize]> {
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
        crate::fast::simd::dispatch(
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
pub(crate) fn check_finite_option(option: &str, x: f64) -> Result<()> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(Error::option(option, format!("must be finite, got {x}")))
    }
}

/// A validated 4-D tensor as `Array4` (caller checked the rank).
pub(crate) fn to4<T: Scalar>(x: &ArrayD<T>) -> Array4<T> {
    view4(x).to_owned()
}

/// A validated 4-D tensor viewed as 4-D (caller checked the rank).
pub(crate) fn view4<T: Scalar>(x: &ArrayD<T>) -> ArrayView4<'_, T> {
    x.view()
        .into_dimensionality::<Ix4>()
        .expect("rank checked by validation")
}

/// Rows `seg.start..seg.end` of head `h` of batch row `seg.batch`: `[L, D]`.
pub(crate) fn gather<T: Scalar, S: Data<Elem = T>>(
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

/// Rows `seg.start..seg.end` of head `h` of `x [B, T, heads, D]`, `[L, D]`,
/// borrowed: strided by the other heads, each row contiguous where `x` is
/// row-major.
pub(crate) fn head_view<'a, T>(x: ArrayView4<'a, T>, seg: &Segment, h: usize) -> ArrayView2<'a, T> {
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
pub(crate) fn assemble<T: Scalar>(
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

/// `cast` over an optional tensor.
pub(crate) fn cast_opt<T: Scalar, U: Scalar>(x: &Option<ArrayD<T>>) -> Option<ArrayD<U>> {
    x.as_ref().map(cast)
}

#[cfg(test)]
mod tests {
    use super::*;

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
