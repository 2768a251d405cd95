//! Token-shift (SPEC §5): `y_t = x_{t−1} − x_t` per sequence, `x_{−1}` being
//! `cache[n]` (or 0). `final_cache[n]` is the sequence's last token; for a
//! zero-length sequence it passes `cache[n]` (or 0) through unchanged, like a
//! recurrent state over no tokens.

use ndarray::{s, Array1, Array2, Array3, ArrayD, ArrayView1, ArrayView3, Ix2, Ix3};

use crate::error::{Error, Result};
use crate::scalar::Scalar;
use crate::tensor::{check_finite, expect_rank, expect_shape};
use crate::varlen::{self, Segment};

#[derive(Clone, Debug)]
pub struct TokenShiftInputs<T> {
    /// `[B, T, D]`
    pub x: ArrayD<T>,
    /// `[N, D]`: the token before each sequence.
    pub cache: Option<ArrayD<T>>,
    /// `[N + 1]`, varlen mode (B = 1)
    pub cu_seqlens: Option<Vec<i64>>,
}

impl<T: Scalar> TokenShiftInputs<T> {
    /// The same inputs in another scalar.
    pub fn cast<U: Scalar>(&self) -> TokenShiftInputs<U> {
        TokenShiftInputs {
            x: crate::tensor::cast(&self.x),
            cache: crate::tensor::cast_opt(&self.cache),
            cu_seqlens: self.cu_seqlens.clone(),
        }
    }
}

/// `y [B, T, D]`, `final_cache [N, D]`.
#[derive(Clone, Debug)]
pub struct TokenShiftOutputs<T> {
    pub y: ArrayD<T>,
    pub final_cache: ArrayD<T>,
}

/// `dx [B, T, D]`, `dcache [N, D]` (when `cache` was given).
#[derive(Clone, Debug)]
pub struct TokenShiftGrads<T> {
    pub dx: ArrayD<T>,
    pub dcache: Option<ArrayD<T>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenShiftDims {
    pub b: usize,
    pub t: usize,
    pub d: usize,
    pub n: usize,
}

pub fn validate<T: Scalar>(x: &TokenShiftInputs<T>) -> Result<(TokenShiftDims, Vec<Segment>)> {
    let xs = expect_rank("x", "B,T,D", &x.x)?;
    let (b, t, d) = (xs[0], xs[1], xs[2]);
    if d == 0 {
        return Err(Error::shape("x", "[B,T,D] with D ≥ 1", xs));
    }
    let segs = varlen::sequences(b, t, x.cu_seqlens.as_deref())?;
    let n = segs.len();
    check_finite("x", &x.x)?;
    if let Some(c) = &x.cache {
        expect_shape("cache", "[N,D]", &[n, d], c.shape())?;
        check_finite("cache", c)?;
    }
    Ok((TokenShiftDims { b, t, d, n }, segs))
}

/// The token before `seg` (cache row or zeros).
fn before<T: Scalar>(cache: Option<&Array2<T>>, seg: &Segment, d: usize) -> Array1<T> {
    cache.map_or_else(|| Array1::zeros(d), |c| c.row(seg.seq).to_owned())
}

/// `y_t = x_{t−1} − x_t` over `seg`, `x_{start−1} = prev`; returns the last
/// token (`prev` for an empty segment).
pub(crate) fn shift_segment<T: Scalar>(
    x: ArrayView3<T>,
    y: &mut Array3<T>,
    seg: &Segment,
    mut prev: Array1<T>,
) -> Array1<T> {
    for t in seg.start..seg.end {
        let cur = x.slice(s![seg.batch, t, ..]);
        y.slice_mut(s![seg.batch, t, ..]).assign(&(&prev - &cur));
        prev = cur.to_owned();
    }
    prev
}

/// Backward of `shift_segment`: `carry` is the gradient of the segment's last
/// token from outside (`dfinal_cache`); returns the gradient of `prev`.
pub(crate) fn shift_segment_backward<T: Scalar>(
    dy: ArrayView3<T>,
    dx: &mut Array3<T>,
    seg: &Segment,
    mut carry: Array1<T>,
) -> Array1<T> {
    for t in (seg.start..seg.end).rev() {
        let dyt: ArrayView1<T> = dy.slice(s![seg.batch, t, ..]);
        dx.slice_mut(s![seg.batch, t, ..]).assign(&(&carry - &dyt));
        carry = dyt.to_owned();
    }
    carry
}

/// As 2-D / 3-D views (validated shapes).
fn view3<T: Scalar>(a: &ArrayD<T>) -> ArrayView3<'_, T> {
    a.view().into_dimensionality::<Ix3>().expect("validated")
}

fn owned2<T: Scalar>(a: &ArrayD<T>) -> Array2<T> {
    a.view()
        .into_dimensionality::<Ix2>()
        .expect("validated")
        .to_owned()
}

/// Forward over every sequence.
pub fn forward<T: Scalar>(x: &TokenShiftInputs<T>) -> Result<TokenShiftOutputs<T>> {
    let (dims, segs) = validate(x)?;
    let cache = x.cache.as_ref().map(owned2);
    let mut y = Array3::zeros((dims.b, dims.t, dims.d));
    let mut final_cache = Array2::zeros((dims.n, dims.d));
    for seg in &segs {
        let last = shift_segment(
            view3(&x.x),
            &mut y,
            seg,
            before(cache.as_ref(), seg, dims.d),
        );
        final_cache.row_mut(seg.seq).assign(&last);
    }
    Ok(TokenShiftOutputs {
        y: y.into_dyn(),
        final_cache: final_cache.into_dyn(),
    })
}

/// Validates `dy [B,T,D]` and `dfinal_cache [N,D]`.
pub fn validate_upstream<T: Scalar>(
    d: &TokenShiftDims,
    dy: &ArrayD<T>,
    dfinal_cache: Option<&ArrayD<T>>,
) -> Result<()> {
    expect_shape("dy", "[B,T,D]", &[d.b, d.t, d.d], dy.shape())?;
    check_finite("dy", dy)?;
    if let Some(df) = dfinal_cache {
        expect_shape("dfinal_cache", "[N,D]", &[d.n, d.d], df.shape())?;
        check_finite("dfinal_cache", df)?;
    }
    Ok(())
}

/// Backward from `dy [B,T,D]` and optional `dfinal_cache [N,D]`.
pub fn backward<T: Scalar>(
    x: &TokenShiftInputs<T>,
    dy: &ArrayD<T>,
    dfinal_cache: Option<&ArrayD<T>>,
) -> Result<TokenShiftGrads<T>> {
    let (dims, segs) = validate(x)?;
    validate_upstream(&dims, dy, dfinal_cache)?;
    let dfc = dfinal_cache.map(owned2);
    let mut dx = Array3::zeros((dims.b, dims.t, dims.d));
    let mut dcache = Array2::zeros((dims.n, dims.d));
    for seg in &segs {
        let carry = before(dfc.as_ref(), seg, dims.d);
        let d_prev = shift_segment_backward(view3(dy), &mut dx, seg, carry);
        dcache.row_mut(seg.seq).assign(&d_prev);
    }
    Ok(TokenShiftGrads {
        dx: dx.into_dyn(),
        dcache: x.cache.as_ref().map(|_| dcache.into_dyn()),
    })
}
