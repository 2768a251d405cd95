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
//! The engine works on one sequence (or CP piece) at a time with its window
//! `[W, D]` (time-major rows of `X`'s prefix); [`cp`] runs the same engine
//! rank by rank.

pub mod cp;

use ndarray::{s, Array1, Array2, Array3, ArrayD, ArrayView1, ArrayView2, Ix1, Ix2, Ix3};

use crate::error::{Error, Result};
use crate::gates::sigmoid;
use crate::scalar::Scalar;
use crate::tensor::{self, check_finite, expect_rank, expect_shape};
use crate::varlen::{self, par_pairs, Segment};

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
pub struct ConvDims {
    pub b: usize,
    pub t: usize,
    pub d: usize,
    pub w: usize,
    /// Number of sequences.
    pub n: usize,
}

/// Validates shapes, `cu_seqlens` and finiteness; returns sizes and sequences.
pub fn validate<T: Scalar>(x: &ConvInputs<T>) -> Result<(ConvDims, Vec<Segment>)> {
    let xs = expect_rank("x", "B,T,D", &x.x)?;
    let (b, t, d) = (xs[0], xs[1], xs[2]);
    if d == 0 {
        return Err(Error::shape("x", "[B,T,D] with D ≥ 1", xs));
    }
    let ws = expect_rank("weight", "D,W", &x.weight)?;
    if ws[0] != d || ws[1] == 0 {
        return Err(Error::shape(
            "weight",
            format!("[D,W] with D = {d} (as x) and kernel width W ≥ 1"),
            ws,
        ));
    }
    let w = ws[1];
    let segs = varlen::sequences(b, t, x.cu_seqlens.as_deref())?;
    let n = segs.len();
    if let Some(bias) = &x.bias {
        expect_shape("bias", "[D]", &[d], bias.shape())?;
    }
    if let Some(h0) = &x.initial_state {
        expect_shape("initial_state", "[N,D,W]", &[n, d, w], h0.shape())?;
    }
    check_finite("x", &x.x)?;
    check_finite("weight", &x.weight)?;
    for (name, a) in [("bias", &x.bias), ("initial_state", &x.initial_state)] {
        if let Some(a) = a {
            check_finite(name, a)?;
        }
    }
    Ok((ConvDims { b, t, d, w, n }, segs))
}

/// Validates `dy [B,T,D]` and `dht [N,D,W]`.
pub fn validate_upstream<T: Scalar>(
    d: &ConvDims,
    dy: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<()> {
    expect_shape("dy", "[B,T,D]", &[d.b, d.t, d.d], dy.shape())?;
    check_finite("dy", dy)?;
    if let Some(dht) = dht {
        expect_shape("dht", "[N,D,W]", &[d.n, d.d, d.w], dht.shape())?;
        check_finite("dht", dht)?;
    }
    Ok(())
}

/// Validated inputs as fixed-rank views, shared by the forms.
pub(crate) struct Prepared<'a, T> {
    pub dims: ConvDims,
    pub segments: Vec<Segment>,
    /// `[B, T, D]`
    pub x: ndarray::ArrayView3<'a, T>,
    /// `[D, W]`
    pub weight: ArrayView2<'a, T>,
    /// `[D]`
    pub bias: Option<ArrayView1<'a, T>>,
    /// `[N, D, W]`
    pub h0: Option<ndarray::ArrayView3<'a, T>>,
    pub act: Activation,
}

impl<'a, T: Scalar> Prepared<'a, T> {
    pub fn new(x: &'a ConvInputs<T>, opt: &ConvOptions) -> Result<Self> {
        let (dims, segments) = validate(x)?;
        let v3 = |a: &'a ArrayD<T>| a.view().into_dimensionality::<Ix3>().expect("validated");
        Ok(Prepared {
            dims,
            segments,
            x: v3(&x.x),
            weight: x
                .weight
                .view()
                .into_dimensionality::<Ix2>()
                .expect("validated"),
            bias: x
                .bias
                .as_ref()
                .map(|b| b.view().into_dimensionality::<Ix1>().expect("validated")),
            h0: x.initial_state.as_ref().map(v3),
            act: opt.activation,
        })
    }

    /// The window `[W, D]` (time-major) before sequence `seq`: its initial
    /// state transposed, or zeros.
    pub fn initial_window(&self, seq: usize) -> Array2<T> {
        match &self.h0 {
            Some(h0) => h0.slice(s![seq, .., ..]).t().to_owned(),
            None => Array2::zeros((self.dims.w, self.dims.d)),
        }
    }

    /// Tokens `[L, D]` of `seg`.
    pub fn tokens(&self, seg: &Segment) -> ArrayView2<'_, T> {
        self.x.slice(s![seg.batch, seg.start..seg.end, ..])
    }

    /// One piece forward from its window `[W, D]`.
    pub fn piece_forward(&self, seg: &Segment, window: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        piece_forward(self.tokens(seg), window, self.weight, self.bias, self.act)
    }

    /// One piece backward; see [`piece_backward`].
    pub fn piece_backward(
        &self,
        seg: &Segment,
        window: ArrayView2<T>,
        dy: ArrayView2<T>,
        dlast: ArrayView2<T>,
    ) -> PieceGrads<T> {
        piece_backward(
            self.tokens(seg),
            window,
            self.weight,
            self.bias,
            self.act,
            dy,
            dlast,
        )
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
pub fn piece_forward<T: Scalar>(
    x: ArrayView2<T>,
    window: ArrayView2<T>,
    weight: ArrayView2<T>,
    bias: Option<ArrayView1<T>>,
    act: Activation,
) -> (Array2<T>, Array2<T>) {
    let y = pre_activation(x, window, weight, bias).mapv_into(|z| act.eval(z).0);
    (y, last_window(x, window))
}

/// Gradients of one piece.
#[derive(Clone, Debug)]
pub struct PieceGrads<T> {
    /// `[L, D]`
    pub dx: Array2<T>,
    /// `[W, D]`, of the window the piece started from.
    pub dwindow: Array2<T>,
    /// `[D, W]`
    pub dweight: Array2<T>,
    /// `[D]`
    pub dbias: Array1<T>,
}

/// Backward of [`piece_forward`] for `Σ y·dy + Σ last·dlast` (`dy [L, D]`,
/// `dlast [W, D]`).
pub fn piece_backward<T: Scalar>(
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

/// Forward over every sequence (in parallel; each sequence independent).
pub fn forward<T: Scalar>(x: &ConvInputs<T>, opt: &ConvOptions) -> Result<ConvOutputs<T>> {
    let p = Prepared::new(x, opt)?;
    let d = p.dims;
    let results = par_pairs(p.segments.len(), 1, |si, _| {
        let seg = &p.segments[si];
        p.piece_forward(seg, p.initial_window(seg.seq).view())
    });
    let mut y = Array3::zeros((d.b, d.t, d.d));
    let mut ht = Array3::zeros((d.n, d.d, d.w));
    for (seg, (ys, last)) in p.segments.iter().zip(&results) {
        y.slice_mut(s![seg.batch, seg.start..seg.end, ..])
            .assign(ys);
        ht.slice_mut(s![seg.seq, .., ..]).assign(&last.t());
    }
    Ok(ConvOutputs {
        y: y.into_dyn(),
        final_state: opt.output_final_state.then(|| ht.into_dyn()),
    })
}

/// Backward of `Σ y·dy + Σ final_state·dht` (`dht` zero when `None`).
pub fn backward<T: Scalar>(
    x: &ConvInputs<T>,
    opt: &ConvOptions,
    dy: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<ConvGrads<T>> {
    let p = Prepared::new(x, opt)?;
    let d = p.dims;
    validate_upstream(&d, dy, dht)?;
    let dy = dy.view().into_dimensionality::<Ix3>().expect("validated");
    let dht = dht.map(|a| a.view().into_dimensionality::<Ix3>().expect("validated"));
    let results = par_pairs(p.segments.len(), 1, |si, _| {
        let seg = &p.segments[si];
        let dlast = match &dht {
            Some(a) => a.slice(s![seg.seq, .., ..]).t().to_owned(),
            None => Array2::zeros((d.w, d.d)),
        };
        p.piece_backward(
            seg,
            p.initial_window(seg.seq).view(),
            dy.slice(s![seg.batch, seg.start..seg.end, ..]),
            dlast.view(),
        )
    });
    let mut acc = GradAccumulator::new(&d);
    for (seg, g) in p.segments.iter().zip(&results) {
        acc.add_piece(seg, g);
        acc.dh0
            .slice_mut(s![seg.seq, .., ..])
            .assign(&g.dwindow.t());
    }
    Ok(acc.finish(x))
}

/// Sums per-piece gradients in piece order (thread-count independent).
pub(crate) struct GradAccumulator<T> {
    pub dx: Array3<T>,
    pub dweight: Array2<T>,
    pub dbias: Array1<T>,
    /// `[N, D, W]`
    pub dh0: Array3<T>,
}

impl<T: Scalar> GradAccumulator<T> {
    pub fn new(d: &ConvDims) -> Self {
        GradAccumulator {
            dx: Array3::zeros((d.b, d.t, d.d)),
            dweight: Array2::zeros((d.d, d.w)),
            dbias: Array1::zeros(d.d),
            dh0: Array3::zeros((d.n, d.d, d.w)),
        }
    }

    /// Token gradients of `seg` and its share of `dweight`, `dbias`.
    pub fn add_piece(&mut self, seg: &Segment, g: &PieceGrads<T>) {
        self.dx
            .slice_mut(s![seg.batch, seg.start..seg.end, ..])
            .assign(&g.dx);
        self.dweight += &g.dweight;
        self.dbias += &g.dbias;
    }

    pub fn finish(self, x: &ConvInputs<T>) -> ConvGrads<T> {
        ConvGrads {
            dx: self.dx.into_dyn(),
            dweight: self.dweight.into_dyn(),
            dbias: x.bias.as_ref().map(|_| self.dbias.into_dyn()),
            dh0: x.initial_state.as_ref().map(|_| self.dh0.into_dyn()),
        }
    }
}
