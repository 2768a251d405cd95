//! Token-shift (SPEC §5): `y_t = x_{t−1} − x_t` per sequence, `x_{−1}` being
//! `cache[n]` (or 0). `final_cache[n]` is the sequence's last token; for a
//! zero-length sequence it passes `cache[n]` (or 0) through unchanged, like a
//! recurrent state over no tokens.

use ndarray::{s, Array2, Array3, ArrayD, ArrayView1, Ix2, Ix3};

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
fn before<T: Scalar>(cache: Option<&Array2<T>>, seg: &Segment, d: usize) -> ndarray::Array1<T> {
    cache.map_or_else(|| ndarray::Array1::zeros(d), |c| c.row(seg.seq).to_owned())
}

/// Forward over every sequence.
pub fn forward<T: Scalar>(x: &TokenShiftInputs<T>) -> Result<TokenShiftOutputs<T>> {
    let (dims, segs) = validate(x)?;
    let xx = x.x.view().into_dimensionality::<Ix3>().expect("validated");
    let cache = x.cache.as_ref().map(|c| {
        c.view()
            .into_dimensionality::<Ix2>()
            .expect("validated")
            .to_owned()
    });
    let mut y = Array3::zeros((dims.b, dims.t, dims.d));
    let mut final_cache = Array2::zeros((dims.n, dims.d));
    for seg in &segs {
        let mut prev = before(cache.as_ref(), seg, dims.d);
        for t in seg.start..seg.end {
            let cur = xx.slice(s![seg.batch, t, ..]);
            y.slice_mut(s![seg.batch, t, ..]).assign(&(&prev - &cur));
            prev = cur.to_owned();
        }
        final_cache.row_mut(seg.seq).assign(&prev);
    }
    Ok(TokenShiftOutputs {
        y: y.into_dyn(),
        final_cache: final_cache.into_dyn(),
    })
}

/// Backward from `dy [B,T,D]` and optional `dfinal_cache [N,D]`.
pub fn backward<T: Scalar>(
    x: &TokenShiftInputs<T>,
    dy: &ArrayD<T>,
    dfinal_cache: Option<&ArrayD<T>>,
) -> Result<TokenShiftGrads<T>> {
    let (dims, segs) = validate(x)?;
    expect_shape("dy", "[B,T,D]", &[dims.b, dims.t, dims.d], dy.shape())?;
    check_finite("dy", dy)?;
    if let Some(df) = dfinal_cache {
        expect_shape("dfinal_cache", "[N,D]", &[dims.n, dims.d], df.shape())?;
        check_finite("dfinal_cache", df)?;
    }
    let dy = dy.view().into_dimensionality::<Ix3>().expect("validated");
    let dfc = dfinal_cache.map(|d| d.view().into_dimensionality::<Ix2>().expect("validated"));
    let mut dx = Array3::zeros((dims.b, dims.t, dims.d));
    let mut dcache = Array2::zeros((dims.n, dims.d));
    for seg in &segs {
        // Gradient flowing into "the previous token" from the right.
        let mut carry = dfc.map_or_else(
            || ndarray::Array1::zeros(dims.d),
            |d| d.row(seg.seq).to_owned(),
        );
        for t in (seg.start..seg.end).rev() {
            let dyt: ArrayView1<T> = dy.slice(s![seg.batch, t, ..]);
            dx.slice_mut(s![seg.batch, t, ..]).assign(&(&carry - &dyt));
            carry = dyt.to_owned();
        }
        dcache.row_mut(seg.seq).assign(&carry);
    }
    Ok(TokenShiftGrads {
        dx: dx.into_dyn(),
        dcache: x.cache.as_ref().map(|_| dcache.into_dyn()),
    })
}
