//! Token-shift (SPEC §5): `y_t = x_{t−1} − x_t` per sequence, `x_{−1}` being
//! `cache[n]` (or 0). `final_cache[n]` is the sequence's last token; for a
//! zero-length sequence it passes `cache[n]` (or 0) through unchanged, like a
//! recurrent state over no tokens. Under the operator contract the cache is
//! the state (`[1, D]` per sequence, one head), so CP hands the previous
//! rank's last token over like any other state.

// The registry entry, listed in `registry::OPS`: tools reach it only there.
pub(crate) mod entry;
// The engine pieces: public types without a public path (see the module).
mod pieces;
pub(crate) mod spec;

use ndarray::{
    Array2, Array4, ArrayD, ArrayView1, ArrayView2, ArrayView3, ArrayView4, Axis, Ix2, Ix3,
};

use crate::error::{Error, Result};
use crate::op::{self, Engine, OpSpec, Operator, Shape};
use crate::scalar::Scalar;
use crate::tensor::{self, check_finite, expect_finite, expect_rank};
use crate::varlen::{self, Segment};

pub(crate) use pieces::{Prepared, TokenShiftDims, TokenShiftHead, TokenShiftHeadGrads};

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

/// Token-shift inputs borrowed where they live (a case file's tensors):
/// what validation and the GPU upload read, uncopied. Shapes as in
/// [`TokenShiftInputs`].
#[derive(Clone, Copy, Debug)]
pub struct TokenShiftRefs<'a, T> {
    pub x: &'a ArrayD<T>,
    pub cache: Option<&'a ArrayD<T>>,
    pub cu_seqlens: Option<&'a [i64]>,
}

impl<T> TokenShiftInputs<T> {
    /// The inputs borrowed.
    pub fn refs(&self) -> TokenShiftRefs<'_, T> {
        TokenShiftRefs {
            x: &self.x,
            cache: self.cache.as_ref(),
            cu_seqlens: self.cu_seqlens.as_deref(),
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

/// Validates shapes, `cu_seqlens` and finiteness; returns sizes and sequences.
pub(crate) fn validate<T: Scalar>(
    x: &TokenShiftInputs<T>,
) -> Result<(TokenShiftDims, Vec<Segment>)> {
    x.refs().validate()
}

impl<T: Scalar> TokenShiftRefs<'_, T> {
    /// Validates borrowed inputs (shapes as in the owned inputs); returns the
    /// problem sizes and the sequences.
    pub fn validate(&self) -> Result<(TokenShiftDims, Vec<Segment>)> {
        let x = self;
        let xs = expect_rank("x", "B,T,D", x.x)?;
        let (b, t, d) = (xs[0], xs[1], xs[2]);
        if d == 0 {
            return Err(Error::shape("x", "[B,T,D] with D ≥ 1", xs));
        }
        let segs = varlen::sequences(b, t, x.cu_seqlens)?;
        let n = segs.len();
        check_finite("x", x.x)?;
        if let Some(c) = x.cache {
            expect_finite("cache", "[N,D]", &[n, d], c)?;
        }
        Ok((TokenShiftDims { b, t, d, n }, segs))
    }
}

impl<'a, T: Scalar> Prepared<'a, T> {
    pub fn new(x: &'a TokenShiftInputs<T>) -> Result<Self> {
        let (dims, segments) = validate(x)?;
        Ok(Prepared {
            dims,
            segments,
            x: view3(&x.x).insert_axis(Axis(2)),
            cache: x.cache.as_ref().map(state_view),
        })
    }
}

/// `[N, D]` as the `[N, 1, 1, D]` state.
fn state_view<T: Scalar>(a: &ArrayD<T>) -> ArrayView4<'_, T> {
    a.view()
        .into_dimensionality::<Ix2>()
        .expect("validated")
        .insert_axis(Axis(1))
        .insert_axis(Axis(1))
}

/// As a 3-D view (validated shape).
fn view3<T: Scalar>(a: &ArrayD<T>) -> ArrayView3<'_, T> {
    a.view().into_dimensionality::<Ix3>().expect("validated")
}

impl<T: Scalar> op::Prepared<T> for Prepared<'_, T> {
    fn shape(&self) -> Shape {
        let d = self.dims;
        Shape {
            b: d.b,
            t: d.t,
            n: d.n,
            heads: 1,
            k: 1,
            v: d.d,
        }
    }

    fn segments(&self) -> &[Segment] {
        &self.segments
    }

    fn h0(&self) -> Option<ArrayView4<'_, T>> {
        self.cache.as_ref().map(|c| c.view())
    }
}

/// The one engine: `y_t = x_{t−1} − x_t`, the state being the last token.
#[derive(Clone, Copy, Debug, Default)]
pub struct Shift;

impl<T: Scalar> Engine<T> for Shift {
    type Op = TokenShift;

    fn forward(&self, x: &TokenShiftHead<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        let mut prev = h0.row(0).to_owned();
        let mut y = Array2::zeros(x.x.raw_dim());
        for (cur, mut yt) in x.x.rows().into_iter().zip(y.rows_mut()) {
            yt.assign(&(&prev - &cur));
            prev = cur.to_owned();
        }
        (y, prev.insert_axis(Axis(0)))
    }

    /// `dx_t = dy_{t+1} − dy_t`, `dy_L` being `dht` (the last token's
    /// gradient from outside); `dcache = dy_0`.
    fn backward(
        &self,
        x: &TokenShiftHead<T>,
        _h0: ArrayView2<T>,
        dy: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> TokenShiftHeadGrads<T> {
        let mut carry = dht.row(0).to_owned();
        let mut dx = Array2::zeros(x.x.raw_dim());
        for t in (0..x.x.nrows()).rev() {
            let dyt: ArrayView1<T> = dy.row(t);
            dx.row_mut(t).assign(&(&carry - &dyt));
            carry = dyt.to_owned();
        }
        TokenShiftHeadGrads {
            dx,
            dcache: carry.insert_axis(Axis(0)),
        }
    }
}

/// Token-shift, FLA's `fla.modules.token_shift`.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenShift;

impl OpSpec for TokenShift {
    const NAME: &'static str = "token_shift";
    const INPUTS: &'static [&'static str] = &["x", "cache", "cu_seqlens"];
    const OUTPUTS: &'static [&'static str] = &["y", "final_cache"];
    const UPSTREAM: &'static [&'static str] = &["dy", "dfinal_cache"];
    const GRADS: &'static [&'static str] = &["dx", "dcache"];
    /// FLA's token shift takes no options beyond its tensors.
    type Options = ();

    fn all_outputs(_: &()) {}
}

impl<T: Scalar> Operator<T> for TokenShift {
    type Inputs = TokenShiftInputs<T>;
    type Outputs = TokenShiftOutputs<T>;
    type Grads = TokenShiftGrads<T>;
    type Head<'h> = TokenShiftHead<T>;
    type HeadGrads = TokenShiftHeadGrads<T>;
    type Prepared<'a>
        = Prepared<'a, T>
    where
        T: 'a;

    fn prepare<'a>(x: &'a TokenShiftInputs<T>, _: &()) -> Result<Prepared<'a, T>> {
        Prepared::new(x)
    }

    fn head(p: &Prepared<'_, T>, seg: &Segment, h: usize) -> TokenShiftHead<T> {
        TokenShiftHead {
            x: tensor::gather(&p.x, seg, h),
        }
    }

    fn cu_seqlens(x: &TokenShiftInputs<T>) -> Option<&[i64]> {
        x.cu_seqlens.as_deref()
    }

    fn validate_upstream(
        p: &Prepared<'_, T>,
        dy: &ArrayD<T>,
        dfinal_cache: Option<&ArrayD<T>>,
    ) -> Result<()> {
        p.dims.validate_upstream(dy, dfinal_cache)
    }

    fn upstream_view(dy: &ArrayD<T>) -> ArrayView4<'_, T> {
        view3(dy).insert_axis(Axis(2))
    }

    fn dht_view<'d>(_: &(), dfinal_cache: &'d ArrayD<T>) -> ArrayView4<'d, T> {
        state_view(dfinal_cache)
    }

    fn probe<'h>(x: &Self::Head<'h>) -> (Self::Head<'h>, usize) {
        let probe = TokenShiftHead {
            x: Array2::zeros((x.x.nrows(), 1)),
        };
        (probe, 1)
    }

    fn outputs(_: &(), o: Array4<T>, final_state: Array4<T>) -> TokenShiftOutputs<T> {
        TokenShiftOutputs {
            y: o.index_axis_move(Axis(2), 0).into_dyn(),
            final_cache: final_state
                .index_axis_move(Axis(1), 0)
                .index_axis_move(Axis(1), 0)
                .into_dyn(),
        }
    }

    fn grads(
        x: &TokenShiftInputs<T>,
        _: &(),
        p: &Prepared<'_, T>,
        pieces: Vec<(Segment, usize, TokenShiftHeadGrads<T>)>,
        dh0: Array4<T>,
    ) -> TokenShiftGrads<T> {
        let d = p.dims;
        let blocks = pieces
            .into_iter()
            .map(|(seg, h, g)| (seg, h, g.dx))
            .collect();
        let dx = tensor::assemble((d.b, d.t, 1, d.d), blocks);
        TokenShiftGrads {
            dx: dx.index_axis_move(Axis(2), 0).into_dyn(),
            dcache: x.cache.as_ref().map(|_| {
                dh0.index_axis_move(Axis(1), 0)
                    .index_axis_move(Axis(1), 0)
                    .into_dyn()
            }),
        }
    }

    fn output_tensors(out: &TokenShiftOutputs<T>) -> Vec<Option<&ArrayD<T>>> {
        vec![Some(&out.y), Some(&out.final_cache)]
    }

    fn grad_tensors(gr: &TokenShiftGrads<T>) -> Vec<Option<&ArrayD<T>>> {
        vec![Some(&gr.dx), gr.dcache.as_ref()]
    }

    fn head_dh0(g: &TokenShiftHeadGrads<T>) -> &Array2<T> {
        &g.dcache
    }

    crate::grads_collected!();

    fn narrow(x: &TokenShiftInputs<f64>) -> TokenShiftInputs<T> {
        x.cast()
    }
}

impl TokenShiftDims {
    /// Validates `dy [B,T,D]` and `dfinal_cache [N,D]`.
    pub fn validate_upstream<T: Scalar>(
        &self,
        dy: &ArrayD<T>,
        dfinal_cache: Option<&ArrayD<T>>,
    ) -> Result<()> {
        let d = self;
        expect_finite("dy", "[B,T,D]", &[d.b, d.t, d.d], dy)?;
        if let Some(df) = dfinal_cache {
            expect_finite("dfinal_cache", "[N,D]", &[d.n, d.d], df)?;
        }
        Ok(())
    }
}
