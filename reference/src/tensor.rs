//! Shape and value checks shared by every operator, and the gather/scatter
//! between FLA's time-major `[B, T, heads, D]` tensors and the per-head
//! `[L, D]` blocks the engines work on.

use ndarray::{
    s, Array2, Array4, ArrayBase, ArrayD, ArrayView2, ArrayView4, CowArray, Data, Ix2, Ix4,
};

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
    let first_bad = if flat.len() >= PAR_CAST {
        use rayon::prelude::*;
        flat.par_chunks(PAR_CAST)
            .enumerate()
            .find_map_first(|(i, part)| scan(part).map(|p| i * PAR_CAST + p))
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

/// Rows `seg.start..seg.end` of head `h` of `x [B, T, heads, D]` as
/// `[L, D]` in standard layout: a view where they already are so (one head,
/// or one row), else a copy ([`gather`]).
pub fn head_rows<'a, T: Scalar>(
    x: ArrayView4<'a, T>,
    seg: &Segment,
    h: usize,
) -> CowArray<'a, T, Ix2> {
    let rows = x.slice_move(s![seg.batch, seg.start..seg.end, h, ..]);
    if rows.is_standard_layout() {
        CowArray::from(rows)
    } else {
        CowArray::from(gather(&x, seg, h))
    }
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

/// Converts between scalars (through `f64`: exact widening, rounded narrowing).
pub fn cast<T: Scalar, U: Scalar>(x: &ArrayD<T>) -> ArrayD<U> {
    // A long case's tensors hold 10⁸ values: convert them on every core.
    match x.as_slice() {
        Some(s) if s.len() >= PAR_CAST => {
            use rayon::prelude::*;
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

    /// [`finish`](Self::finish) of four sums at once, with the same bits.
    /// Pairing the lanes across the sums (`lo = [a₀+a₁, b₀+b₁, …]`,
    /// `hi = [a₂+a₃, …]`) makes the three adds of each sum vector adds over
    /// all four instead of twelve scalar ones: the KDA naive backward, which
    /// finishes four sums per state row, runs about 15 % faster.
    #[inline(always)]
    pub fn finish4(sums: [Self; 4]) -> [T; 4] {
        let [a, b, c, d] = std::hint::black_box(sums.map(|s| s.lanes));
        let lo = [a[0] + a[1], b[0] + b[1], c[0] + c[1], d[0] + d[1]];
        let hi = [a[2] + a[3], b[2] + b[3], c[2] + c[3], d[2] + d[3]];
        std::array::from_fn(|i| (lo[i] + hi[i]) + sums[i].tail)
    }
}

impl<T: Scalar> Default for DotSum<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// FLA's kernels use chunks of 16, 32 or 64 tokens.
pub fn check_chunk_size(chunk_size: usize) -> Result<()> {
    if [16, 32, 64].contains(&chunk_size) {
        Ok(())
    } else {
        Err(Error::option(
            "chunk_size",
            format!("must be 16, 32 or 64, got {chunk_size}"),
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
    let mut n = Array2::<T>::eye(c);
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

    /// Four sums finished together have the bits of each finished alone,
    /// in f64 and f32, for lanes of mixed magnitudes and signs (where the
    /// order of the adds shows in the result) and for `−0` and empty tails.
    #[test]
    fn four_sums_finish_with_the_bits_of_each() {
        fn check<T: Scalar + std::fmt::Debug>(rng: &crate::rng::Stream) {
            let mut reordered_differs = false;
            for case in 0..2000u64 {
                let sums: [DotSum<T>; 4] = std::array::from_fn(|s| {
                    let draw = |l: u64| {
                        let (x, e) = (
                            rng.normal(case * 40 + s as u64 * 8 + l),
                            rng.uniform(case, s as u64 * 8 + l),
                        );
                        T::c(x * 2f64.powi((e * 60.0) as i32 - 30))
                    };
                    let tail = match case % 3 {
                        0 => -T::zero(),
                        1 => T::zero(),
                        _ => draw(4),
                    };
                    DotSum {
                        lanes: [draw(0), draw(1), draw(2), draw(3)],
                        tail,
                    }
                });
                let alone = sums.map(DotSum::finish);
                let together = DotSum::finish4(sums);
                for (a, b) in alone.iter().zip(&together) {
                    assert_eq!(a.f64().to_bits(), b.f64().to_bits(), "{sums:?}");
                }
                let l = sums[0].lanes;
                reordered_differs |= ((l[0] + l[2]) + (l[1] + l[3]) + sums[0].tail) != alone[0];
            }
            assert!(
                reordered_differs,
                "the draws never expose the order of the adds"
            );
        }
        let rng = crate::rng::Stream::new(3, "finish4");
        check::<f64>(&rng);
        check::<f32>(&rng);
    }

    /// One head's rows are borrowed where they are contiguous (one head, or
    /// one row of several) and copied where they are strided; either way
    /// they are the head's values in standard layout.
    #[test]
    fn head_rows_borrow_contiguous_rows_and_copy_strided_ones() {
        let one = Array4::from_shape_fn((2, 7, 1, 3), |(b, t, _, d)| (100 * b + 10 * t + d) as f64);
        let rows = head_rows(one.view(), &seg(1, 2, 6), 0);
        assert!(rows.is_view() && rows.is_standard_layout());
        assert_eq!(
            rows.as_ptr(),
            one.slice(s![1, 2, 0, ..]).as_ptr(),
            "borrowed"
        );
        assert_eq!(rows, one.slice(s![1, 2..6, 0, ..]));
        let three =
            Array4::from_shape_fn((1, 7, 3, 2), |(_, t, h, d)| (100 * h + 10 * t + d) as f64);
        let strided = head_rows(three.view(), &seg(0, 1, 5), 2);
        assert!(strided.is_owned() && strided.is_standard_layout());
        assert_eq!(strided, gather(&three, &seg(0, 1, 5), 2));
        assert!(
            head_rows(three.view(), &seg(0, 4, 5), 1).is_view(),
            "a single row"
        );
    }

    /// A tensor long enough to be scanned in parallel parts names the
    /// first bad value, not whichever part finished first.
    #[test]
    fn check_finite_names_the_first_bad_index_of_a_long_tensor() {
        let mut x = ArrayD::<f64>::zeros(ndarray::IxDyn(&[3 * PAR_CAST / 4 + 2, 4]));
        assert!(check_finite("x", &x).is_ok());
        let flat = x.as_slice_mut().expect("standard layout");
        flat[2 * PAR_CAST + 7] = f64::INFINITY;
        flat[PAR_CAST + 3] = f64::NAN;
        match check_finite("x", &x) {
            Err(Error::NonFinite { tensor, index, .. }) => {
                assert_eq!(tensor, "x");
                let at = PAR_CAST + 3;
                assert_eq!(index, vec![at / 4, at % 4]);
            }
            other => panic!("expected NonFinite, got {other:?}"),
        }
    }
}
