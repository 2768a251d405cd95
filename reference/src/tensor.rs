//! Shape and value checks shared by every operator, and the gather/scatter
//! between FLA's time-major `[B, T, heads, D]` tensors and the per-head
//! `[L, D]` blocks the engines work on.

use ndarray::{s, Array2, Array4, ArrayD, ArrayView2, Ix4};

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
    match flat.iter().position(|v| !v.is_finite()) {
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

/// Checks a scalar option is finite.
pub fn check_finite_option(option: &str, x: f64) -> Result<()> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(Error::option(option, format!("must be finite, got {x}")))
    }
}

/// A validated 4-D tensor view as `Array4` (caller checked the rank).
pub fn to4<T: Scalar>(x: &ArrayD<T>) -> Array4<T> {
    x.view()
        .into_dimensionality::<Ix4>()
        .expect("rank checked by validation")
        .to_owned()
}

/// Rows `seg.start..seg.end` of head `h` of batch row `seg.batch`: `[L, D]`.
pub fn gather<T: Scalar>(x: &Array4<T>, seg: &Segment, h: usize) -> Array2<T> {
    x.slice(s![seg.batch, seg.start..seg.end, h, ..])
        .as_standard_layout()
        .into_owned()
}

/// Writes an `[L, D]` block back at the place `gather` took it from.
pub fn scatter<T: Scalar>(dst: &mut Array4<T>, seg: &Segment, h: usize, src: ArrayView2<T>) {
    dst.slice_mut(s![seg.batch, seg.start..seg.end, h, ..])
        .assign(&src);
}

/// Converts between scalars (through `f64`: exact widening, rounded narrowing).
pub fn cast<T: Scalar, U: Scalar>(x: &ArrayD<T>) -> ArrayD<U> {
    x.mapv(|v| U::c(v.f64()))
}

/// `cast` over an optional tensor.
pub fn cast_opt<T: Scalar, U: Scalar>(x: &Option<ArrayD<T>>) -> Option<ArrayD<U>> {
    x.as_ref().map(cast)
}

/// `Σ a_i b_i` with four independent partial sums (fixed order, so
/// deterministic): a strict left-to-right sum is one long dependency chain.
#[inline]
pub fn dot<T: Scalar>(a: &[T], b: &[T]) -> T {
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: T = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&x, &y)| x * y)
        .sum();
    let mut acc = [T::zero(); 4];
    for (x, y) in ca.zip(cb) {
        for l in 0..4 {
            acc[l] += x[l] * y[l];
        }
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
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
