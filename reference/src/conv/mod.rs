//! Causal conv1d, FLA's `causal_conv1d` (`fla/modules/causal_conv1d/`): a
//! depthwise causal convolution of width `W` over each sequence,
//! `y_t[d] = act(Σ_{i<W} weight[d, i] · X[t + 1 + i, d] + bias[d])`,
//! where `X = [state_0, …, state_{W−1}, x_0, x_1, …]` is the sequence
//! extended on the left by its `W` cached tokens (`initial_state[n]`, `[D, W]`,
//! column `W − 1` the most recent; zeros when absent). Only the last `W − 1`
//! cached tokens reach `y`; `final_state[n]` is the last `W` entries of `X`
//! (so a sequence shorter than `W` keeps part of its initial state, and one
//! without tokens passes it through). `act` is the identity or SiLU.
//!
//! Under the operator contract ([`crate::op`]) the window is the state: one
//! head, `[K, V] = [W, D]` (time-major rows of `X`'s prefix). The state
//! recurrence "drop the oldest row, append the token" is linear in
//! `(state, x)`, so the generic CP hands windows from rank to rank through
//! the transition `M` (a shift, zero once a piece has `W` tokens): a rank
//! gets the `W` tokens before its cut from however many earlier ranks hold
//! them (FLA's `causal_conv1d_cp` sends the previous rank's last `W − 1` and
//! needs at least that many tokens per rank), and in backward the window's
//! gradient flows back to those tokens.

// The registry entry, listed in `registry::OPS`: tools reach it only there.
pub(crate) mod entry;
// The engine pieces: public types without a public path (see the module).
mod pieces;
pub(crate) mod spec;

use ndarray::{
    s, Array1, Array2, Array4, ArrayD, ArrayView1, ArrayView2, ArrayView3, ArrayView4, Axis, Ix1,
    Ix2, Ix3,
};

use crate::error::{Error, Result};
use crate::gates::sigmoid;
use crate::op::{self, Engine, OpSpec, Operator, Shape};
use crate::scalar::Scalar;
use crate::tensor::{self, check_finite, expect_finite, expect_rank, expect_shape};
use crate::varlen::{self, Segment};

pub(crate) use pieces::{ConvHead, PieceGrads, Prepared};

/// The activation applied to the convolution (FLA `activation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Activation {
    /// FLA's `None`.
    #[default]
    None,
    /// `z · sigmoid(z)` (FLA accepts `"silu"` and `"swish"`).
    Silu,
}

impl Activation {
    /// Parses FLA's names: `"none"` (Python `None`), `"silu"`, `"swish"`.
    pub fn parse(s: &str) -> Result<Activation> {
        match s {
            "none" => Ok(Activation::None),
            "silu" | "swish" => Ok(Activation::Silu),
            other => Err(Error::option(
                "activation",
                format!("unknown activation `{other}` (none, silu, swish)"),
            )),
        }
    }

    /// The case-file name (`"none"`, `"silu"`).
    pub fn name(self) -> &'static str {
        match self {
            Activation::None => "none",
            Activation::Silu => "silu",
        }
    }

    /// `(act(z), act'(z))`.
    fn eval<T: Scalar>(self, z: T) -> (T, T) {
        match self {
            Activation::None => (z, T::one()),
            Activation::Silu => {
                let sg = sigmoid(z);
                (z * sg, sg * (T::one() + z * (T::one() - sg)))
            }
        }
    }
}

/// Causal conv1d inputs in FLA's layout.
#[derive(Clone, Debug)]
pub struct ConvInputs<T> {
    /// `[B, T, D]`
    pub x: ArrayD<T>,
    /// `[D, W]`, `W ≥ 1`; column `W − 1` multiplies the current token.
    pub weight: ArrayD<T>,
    /// `[D]`
    pub bias: Option<ArrayD<T>>,
    /// `[N, D, W]`: the `W` tokens before each sequence, oldest first.
    pub initial_state: Option<ArrayD<T>>,
    /// `[N + 1]`, varlen mode (B = 1)
    pub cu_seqlens: Option<Vec<i64>>,
}

/// Causal conv1d inputs borrowed where they live (a case file's tensors):
/// what validation reads, uncopied. Shapes as in [`ConvInputs`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConvRefs<'a, T> {
    pub x: &'a ArrayD<T>,
    pub weight: &'a ArrayD<T>,
    pub bias: Option<&'a ArrayD<T>>,
    pub initial_state: Option<&'a ArrayD<T>>,
    pub cu_seqlens: Option<&'a [i64]>,
}

impl<T> ConvInputs<T> {
    /// The inputs borrowed.
    pub(crate) fn refs(&self) -> ConvRefs<'_, T> {
        ConvRefs {
            x: &self.x,
            weight: &self.weight,
            bias: self.bias.as_ref(),
            initial_state: self.initial_state.as_ref(),
            cu_seqlens: self.cu_seqlens.as_deref(),
        }
    }
}

impl<T: Scalar> ConvInputs<T> {
    /// The same inputs in another scalar.
    pub fn cast<U: Scalar>(&self) -> ConvInputs<U> {
        ConvInputs {
            x: tensor::cast(&self.x),
            weight: tensor::cast(&self.weight),
            bias: tensor::cast_opt(&self.bias),
            initial_state: tensor::cast_opt(&self.initial_state),
            cu_seqlens: self.cu_seqlens.clone(),
        }
    }
}

/// FLA `causal_conv1d` options.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ConvOptions {
    pub activation: Activation,
    pub output_final_state: bool,
}

/// `y [B, T, D]`, `final_state [N, D, W]` when asked for.
#[derive(Clone, Debug)]
pub struct ConvOutputs<T> {
    pub y: ArrayD<T>,
    pub final_state: Option<ArrayD<T>>,
}

/// Gradients, each shaped like its input; `None` where the input was absent.
#[derive(Clone, Debug)]
pub struct ConvGrads<T> {
    pub dx: ArrayD<T>,
    pub dweight: ArrayD<T>,
    pub dbias: Option<ArrayD<T>>,
    pub dh0: Option<ArrayD<T>>,
}

/// Sizes of a validated problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConvDims {
    pub b: usize,
    pub t: usize,
    pub d: usize,
    pub w: usize,
    /// Number of sequences.
    pub n: usize,
}

/// Validates shapes, `cu_seqlens` and finiteness; returns sizes and sequences.
pub(crate) fn validate<T: Scalar>(x: &ConvInputs<T>) -> Result<(ConvDims, Vec<Segment>)> {
    validate_refs(&x.refs())
}

/// [`validate`] on borrowed inputs.
pub(crate) fn validate_refs<T: Scalar>(x: &ConvRefs<'_, T>) -> Result<(ConvDims, Vec<Segment>)> {
    let xs = expect_rank("x", "B,T,D", x.x)?;
    let (b, t, d) = (xs[0], xs[1], xs[2]);
    if d == 0 {
        return Err(Error::shape("x", "[B,T,D] with D ≥ 1", xs));
    }
    let ws = expect_rank("weight", "D,W", x.weight)?;
    if ws[0] != d || ws[1] == 0 {
        return Err(Error::shape(
            "weight",
            format!("[D,W] with D = {d} (as x) and kernel width W ≥ 1"),
            ws,
        ));
    }
    let w = ws[1];
    let segs = varlen::sequences(b, t, x.cu_seqlens)?;
    let n = segs.len();
    if let Some(bias) = x.bias {
        expect_shape("bias", "[D]", &[d], bias.shape())?;
    }
    if let Some(h0) = x.initial_state {
        expect_shape("initial_state", "[N,D,W]", &[n, d, w], h0.shape())?;
    }
    check_finite("x", x.x)?;
    check_finite("weight", x.weight)?;
    for (name, a) in [("bias", x.bias), ("initial_state", x.initial_state)] {
        if let Some(a) = a {
            check_finite(name, a)?;
        }
    }
    Ok((ConvDims { b, t, d, w, n }, segs))
}

/// Validates `dy [B,T,D]` and `dht [N,D,W]`.
pub(crate) fn validate_upstream<T: Scalar>(
    d: &ConvDims,
    dy: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<()> {
    expect_finite("dy", "[B,T,D]", &[d.b, d.t, d.d], dy)?;
    if let Some(dht) = dht {
        expect_finite("dht", "[N,D,W]", &[d.n, d.d, d.w], dht)?;
    }
    Ok(())
}

fn view3<T: Scalar>(a: &ArrayD<T>) -> ArrayView3<'_, T> {
    a.view().into_dimensionality::<Ix3>().expect("validated")
}

/// A `[N, D, W]` state as `[N, 1, W, D]` windows (a view).
fn window_view<T: Scalar>(a: &ArrayD<T>) -> ArrayView4<'_, T> {
    let mut v = view3(a).insert_axis(Axis(1));
    v.swap_axes(2, 3);
    v
}

/// `[N, 1, W, D]` windows as the `[N, D, W]` state.
fn state_of<T: Scalar>(w: Array4<T>) -> ArrayD<T> {
    let mut s = w.index_axis_move(Axis(1), 0);
    s.swap_axes(1, 2);
    s.as_standard_layout().into_owned().into_dyn()
}

impl<'a, T: Scalar> Prepared<'a, T> {
    pub fn new(x: &'a ConvInputs<T>, opt: &ConvOptions) -> Result<Self> {
        let (dims, segments) = validate(x)?;
        Ok(Prepared {
            dims,
            segments,
            x: view3(&x.x).insert_axis(Axis(2)),
            weight: x
                .weight
                .view()
                .into_dimensionality::<Ix2>()
                .expect("validated"),
            bias: x
                .bias
                .as_ref()
                .map(|b| b.view().into_dimensionality::<Ix1>().expect("validated")),
            h0: x.initial_state.as_ref().map(window_view),
            act: opt.activation,
        })
    }
}

impl<T: Scalar> op::Prepared<T> for Prepared<'_, T> {
    fn shape(&self) -> Shape {
        let d = self.dims;
        Shape {
            b: d.b,
            t: d.t,
            n: d.n,
            heads: 1,
            k: d.w,
            v: d.d,
        }
    }

    fn segments(&self) -> &[Segment] {
        &self.segments
    }

    fn h0(&self) -> Option<ArrayView4<'_, T>> {
        self.h0.as_ref().map(|h| h.view())
    }
}

/// Row `m` of the extended sequence `X = [window; x]`.
fn ext<'b, T: Scalar>(
    x: &'b ArrayView2<T>,
    window: &'b ArrayView2<T>,
    m: usize,
) -> ArrayView1<'b, T> {
    let w = window.nrows();
    if m < w {
        window.row(m)
    } else {
        x.row(m - w)
    }
}

/// The pre-activation `z [L, D]` of a piece.
fn pre_activation<T: Scalar>(
    x: ArrayView2<T>,
    window: ArrayView2<T>,
    weight: ArrayView2<T>,
    bias: Option<ArrayView1<T>>,
) -> Array2<T> {
    let (l, d, w) = (x.nrows(), x.ncols(), weight.ncols());
    let mut z = Array2::zeros((l, d));
    for t in 0..l {
        let mut zt = z.row_mut(t);
        for i in 0..w {
            let xm = ext(&x, &window, t + 1 + i);
            for c in 0..d {
                zt[c] += weight[[c, i]] * xm[c];
            }
        }
        if let Some(b) = &bias {
            zt += b;
        }
    }
    z
}

/// The last `W` rows of `X = [window; x]` (the state handed on).
fn last_window<T: Scalar>(x: ArrayView2<T>, window: ArrayView2<T>) -> Array2<T> {
    let (l, w) = (x.nrows(), window.nrows());
    let mut out = Array2::zeros(window.raw_dim());
    for j in 0..w {
        out.row_mut(j).assign(&ext(&x, &window, l + j));
    }
    out
}

/// One piece: tokens `x [L, D]`, window `[W, D]`, `weight [D, W]`.
/// Returns `(y [L, D], last window [W, D])`.
pub(crate) fn piece_forward<T: Scalar>(
    x: ArrayView2<T>,
    window: ArrayView2<T>,
    weight: ArrayView2<T>,
    bias: Option<ArrayView1<T>>,
    act: Activation,
) -> (Array2<T>, Array2<T>) {
    let y = pre_activation(x, window, weight, bias).mapv_into(|z| act.eval(z).0);
    (y, last_window(x, window))
}

/// Backward of [`piece_forward`] for `Σ y·dy + Σ last·dlast` (`dy [L, D]`,
/// `dlast [W, D]`).
pub(crate) fn piece_backward<T: Scalar>(
    x: ArrayView2<T>,
    window: ArrayView2<T>,
    weight: ArrayView2<T>,
    bias: Option<ArrayView1<T>>,
    act: Activation,
    dy: ArrayView2<T>,
    dlast: ArrayView2<T>,
) -> PieceGrads<T> {
    let (l, d, w) = (x.nrows(), x.ncols(), weight.ncols());
    let z = pre_activation(x, window, weight, bias);
    let dz = ndarray::Zip::from(&z)
        .and(&dy)
        .map_collect(|&z, &dy| dy * act.eval(z).1);
    // Gradient of every row of X = [window; x].
    let mut dext = Array2::<T>::zeros((w + l, d));
    for j in 0..w {
        let mut row = dext.row_mut(l + j);
        row += &dlast.row(j);
    }
    let mut dweight = Array2::zeros((d, w));
    for t in 0..l {
        let dzt = dz.row(t);
        for i in 0..w {
            let m = t + 1 + i;
            let xm = ext(&x, &window, m);
            for c in 0..d {
                dext[[m, c]] += weight[[c, i]] * dzt[c];
                dweight[[c, i]] += dzt[c] * xm[c];
            }
        }
    }
    let mut dbias = Array1::zeros(d);
    for t in 0..l {
        dbias += &dz.row(t);
    }
    PieceGrads {
        dx: dext.slice(s![w.., ..]).to_owned(),
        dwindow: dext.slice(s![..w, ..]).to_owned(),
        dweight,
        dbias,
    }
}

/// The one engine: the convolution written out, token by token.
#[derive(Clone, Copy, Debug, Default)]
pub struct Direct;

impl<T: Scalar> Engine<T> for Direct {
    type Op = CausalConv1d;

    /// `(y [L, D], last window [W, D])` from the window `h0 [W, D]`.
    fn forward(&self, x: &ConvHead<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        let bias = x.bias.as_ref().map(|b| b.view());
        piece_forward(x.x.view(), h0, x.weight.view(), bias, x.act)
    }

    fn backward(
        &self,
        x: &ConvHead<T>,
        h0: ArrayView2<T>,
        dy: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> PieceGrads<T> {
        let bias = x.bias.as_ref().map(|b| b.view());
        piece_backward(x.x.view(), h0, x.weight.view(), bias, x.act, dy, dht)
    }
}

/// Causal conv1d, FLA's `fla.modules.causal_conv1d.causal_conv1d`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CausalConv1d;

impl OpSpec for CausalConv1d {
    const NAME: &'static str = "causal_conv1d";
    const INPUTS: &'static [&'static str] = &["x", "weight", "bias", "initial_state", "cu_seqlens"];
    const OUTPUTS: &'static [&'static str] = &["y", "final_state"];
    const UPSTREAM: &'static [&'static str] = &["dy", "dht"];
    const GRADS: &'static [&'static str] = &["dx", "dweight", "dbias", "dh0"];
    type Options = ConvOptions;

    fn all_outputs(opt: &ConvOptions) -> ConvOptions {
        ConvOptions {
            output_final_state: true,
            ..*opt
        }
    }
}

impl<T: Scalar> Operator<T> for CausalConv1d {
    type Inputs = ConvInputs<T>;
    type Outputs = ConvOutputs<T>;
    type Grads = ConvGrads<T>;
    type Head<'h> = ConvHead<T>;
    type HeadGrads = PieceGrads<T>;
    type Prepared<'a>
        = Prepared<'a, T>
    where
        T: 'a;

    fn prepare<'a>(x: &'a ConvInputs<T>, opt: &ConvOptions) -> Result<Prepared<'a, T>> {
        Prepared::new(x, opt)
    }

    fn head(p: &Prepared<'_, T>, seg: &Segment, h: usize) -> ConvHead<T> {
        ConvHead {
            x: tensor::gather(&p.x, seg, h),
            weight: p.weight.to_owned(),
            bias: p.bias.map(|b| b.to_owned()),
            act: p.act,
        }
    }

    fn cu_seqlens(x: &ConvInputs<T>) -> Option<&[i64]> {
        x.cu_seqlens.as_deref()
    }

    fn validate_upstream(
        p: &Prepared<'_, T>,
        dy: &ArrayD<T>,
        dht: Option<&ArrayD<T>>,
    ) -> Result<()> {
        validate_upstream(&p.dims, dy, dht)
    }

    fn upstream_view(dy: &ArrayD<T>) -> ArrayView4<'_, T> {
        view3(dy).insert_axis(Axis(2))
    }

    fn dht_view<'d>(_: &ConvOptions, dht: &'d ArrayD<T>) -> ArrayView4<'d, T> {
        window_view(dht)
    }

    /// The window recurrence does not read the weight: with `K = W` zero
    /// columns of x, the final window from `I [W, W]` is the shift `M`.
    fn probe<'h>(x: &Self::Head<'h>) -> (Self::Head<'h>, usize) {
        let w = x.weight.ncols();
        let probe = ConvHead {
            x: Array2::zeros((x.x.nrows(), w)),
            weight: Array2::zeros((w, w)),
            bias: None,
            act: Activation::None,
        };
        (probe, w)
    }

    fn outputs(opt: &ConvOptions, o: Array4<T>, final_state: Array4<T>) -> ConvOutputs<T> {
        ConvOutputs {
            y: o.index_axis_move(Axis(2), 0).into_dyn(),
            final_state: opt.output_final_state.then(|| state_of(final_state)),
        }
    }

    /// `dweight`, `dbias`: the pieces' shares summed in piece order.
    fn grads(
        x: &ConvInputs<T>,
        _: &ConvOptions,
        p: &Prepared<'_, T>,
        pieces: Vec<(Segment, usize, PieceGrads<T>)>,
        dh0: Array4<T>,
    ) -> ConvGrads<T> {
        let d = p.dims;
        let mut pieces = pieces;
        let blocks = pieces
            .iter_mut()
            .map(|(seg, h, g)| (*seg, *h, std::mem::take(&mut g.dx)))
            .collect();
        let dx = tensor::assemble((d.b, d.t, 1, d.d), blocks);
        let mut dweight = Array2::zeros((d.d, d.w));
        let mut dbias = Array1::zeros(d.d);
        for (_, _, g) in &pieces {
            dweight += &g.dweight;
            dbias += &g.dbias;
        }
        ConvGrads {
            dx: dx.index_axis_move(Axis(2), 0).into_dyn(),
            dweight: dweight.into_dyn(),
            dbias: x.bias.as_ref().map(|_| dbias.into_dyn()),
            dh0: x.initial_state.as_ref().map(|_| state_of(dh0)),
        }
    }

    fn output_tensors(out: &ConvOutputs<T>) -> Vec<Option<&ArrayD<T>>> {
        vec![Some(&out.y), out.final_state.as_ref()]
    }

    fn grad_tensors(gr: &ConvGrads<T>) -> Vec<Option<&ArrayD<T>>> {
        vec![
            Some(&gr.dx),
            Some(&gr.dweight),
            gr.dbias.as_ref(),
            gr.dh0.as_ref(),
        ]
    }

    fn head_dh0(g: &PieceGrads<T>) -> &Array2<T> {
        &g.dwindow
    }

    crate::grads_collected!();

    fn narrow(x: &ConvInputs<f64>) -> ConvInputs<T> {
        x.cast()
    }
}
