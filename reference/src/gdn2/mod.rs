//! GDN-2 (Gated DeltaNet 2), FLA's `chunk_gdn2` / `naive_recurrent_gdn2`
//! (fla-core 0.6.0, `fla/ops/gdn2/`). Per (sequence, head), with an erase
//! gate `b_t [K]`, a write gate `w_t [V]` and a log-space decay `g_t [K]`:
//!
//! ```text
//! S_t = (I − k_t (b_t ⊙ k_t)ᵀ) Diag(exp g_t) S_{t−1} + k_t (w_t ⊙ v_t)ᵀ
//! o_t = S_tᵀ (scale · q_t)
//! ```
//!
//! The state is read at the gated key `b ⊙ k` and written at the plain key
//! `k`. `b = w = β` (broadcast) is KDA; a scalar `g` on top of that is GDN.
//!
//! This module owns what the engines share: the public tensors and options
//! (FLA's names), validation, the pre-processing FLA fuses into its kernels
//! (l2norm of q/k, the in-kernel gate) and its backward, and [`Gdn2`], its
//! side of the operator contract ([`crate::op`]). The engines ([`Naive`],
//! [`Chunk`]) see one head of one sequence (or CP piece); CP and the
//! drivers come from [`crate::op`] and [`crate::cp`].
//!
//! Where FLA 0.6.0 fixes a detail the recurrence leaves open, this follows
//! FLA:
//! - `use_gate_in_kernel` picks its form by `lower_bound`, not by
//!   `safe_gate`: with `lower_bound` set the decay is
//!   `lower_bound · sigmoid(exp(A_log)·(g + dt_bias))` (`A_log` optional:
//!   `lower_bound · sigmoid(g + dt_bias)`), else
//!   `−exp(A_log) · softplus(g + dt_bias)` (`A_log` required). `dt_bias` is
//!   added before the `exp(A_log)` factor (the `chunk_gdn2` docstring omits
//!   it; the kernel adds it).
//! - softplus is FLA's: `x` itself above 20 (torch's `F.softplus` default and
//!   FLA's Triton kernel), not `ln(1 + eˣ)`.
//! - `safe_gate` with `use_gate_in_kernel` needs `−5 ≤ lower_bound < 0`;
//!   otherwise `lower_bound` is any finite number, and `safe_gate` alone
//!   checks nothing (it only selects a kernel path: rounding, not maths).
//! - No grouped value attention: `chunk_gdn2` asserts `v`'s heads equal
//!   `q`'s (`fused_recurrent_gdn2` accepts more value heads, and FLA's
//!   layer repeats q, k, g and b before calling `chunk_gdn2`; a GVA problem
//!   is that repeated problem here too).
//! - `state_v_first` only transposes the state tensors (`initial_state`,
//!   `final_state`, `dht`, `dh0`) to `[N, H, V, K]`.
//! - The in-kernel gate's backward: `dg` is with respect to the raw `g`,
//!   `dA_log` and `ddt_bias` exist only where `A_log` / `dt_bias` were given.
//!
//! Stricter than FLA: `A_log`, `dt_bias` or `lower_bound` without
//! `use_gate_in_kernel` are refused (FLA ignores them), and every input must
//! be finite. Looser than FLA: any chunk size the engines take (FLA's
//! kernels take 64 only), an `initial_state` under CP.

pub(crate) mod chunk;
// The registry entry, listed in `registry::OPS`: tools reach it only there.
pub(crate) mod entry;
pub(crate) mod naive;

// The engine pieces: public types without a public path (see the module).
mod pieces;

// The engines, named from here: the forms' modules hold their pieces.
pub use chunk::Chunk;
pub use naive::Naive;

use ndarray::{
    s, Array1, Array2, Array4, ArrayD, ArrayView1, ArrayView4, Axis, CowArray, Ix2, Ix4, IxDyn, Zip,
};

use crate::error::{Error, Result};
use crate::gates::{self, Gate};
use crate::op::{self, OpSpec, Operator, Shape};
use crate::precision::{Policy, Stage};
use crate::scalar::Scalar;
use crate::tensor::{
    self, check_finite, check_finite_option, expect_finite, expect_rank, expect_shape,
};
use crate::varlen::{self, Segment};

pub(crate) use pieces::{Gdn2Dims, Gdn2Head, Gdn2HeadGrads, Prepared};

/// GDN-2 inputs in FLA's layout (`chunk_gdn2`'s argument names).
#[derive(Clone, Debug)]
pub struct Gdn2Inputs<T> {
    /// `[B, T, H, K]`
    pub q: ArrayD<T>,
    /// `[B, T, H, K]`
    pub k: ArrayD<T>,
    /// `[B, T, H, V]` (as many heads as `q`: no GVA in `chunk_gdn2`)
    pub v: ArrayD<T>,
    /// `[B, T, H, K]` log-space decay, or the raw gate input with
    /// `use_gate_in_kernel`.
    pub g: ArrayD<T>,
    /// `[B, T, H, K]` erase gate (used as given; FLA's layer passes a sigmoid).
    pub b: ArrayD<T>,
    /// `[B, T, H, V]` write gate (used as given).
    pub w: ArrayD<T>,
    /// `[H]`, the in-kernel gate's decay rate.
    pub a_log: Option<ArrayD<T>>,
    /// `[H * K]`, the in-kernel gate's bias.
    pub dt_bias: Option<ArrayD<T>>,
    /// `[N, H, K, V]` (`[N, H, V, K]` with `state_v_first`).
    pub initial_state: Option<ArrayD<T>>,
    /// `[N + 1]`, varlen mode (B = 1).
    pub cu_seqlens: Option<Vec<i64>>,
}

impl<T: Scalar> Gdn2Inputs<T> {
    /// The same inputs in another scalar (f64 → f32 to study f32 rounding).
    pub fn cast<U: Scalar>(&self) -> Gdn2Inputs<U> {
        Gdn2Inputs {
            q: tensor::cast(&self.q),
            k: tensor::cast(&self.k),
            v: tensor::cast(&self.v),
            g: tensor::cast(&self.g),
            b: tensor::cast(&self.b),
            w: tensor::cast(&self.w),
            a_log: tensor::cast_opt(&self.a_log),
            dt_bias: tensor::cast_opt(&self.dt_bias),
            initial_state: tensor::cast_opt(&self.initial_state),
            cu_seqlens: self.cu_seqlens.clone(),
        }
    }
}

/// FLA `chunk_gdn2` options (names as in FLA 0.6.0; `A_log` and `dt_bias`,
/// FLA keyword arguments, are tensors of [`Gdn2Inputs`]).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Gdn2Options {
    /// Defaults to `K^-0.5`.
    pub scale: Option<f64>,
    pub output_final_state: bool,
    /// q and k become `x / sqrt(Σx² + 1e-6)` over K first.
    pub use_qk_l2norm_in_kernel: bool,
    /// `g` is raw; the decay is FLA's KDA gate of it (see the module doc).
    pub use_gate_in_kernel: bool,
    /// FLA's TensorCore diagonal path: no change to the maths; with
    /// `use_gate_in_kernel` it requires `−5 ≤ lower_bound < 0`.
    pub safe_gate: bool,
    /// Selects the bounded in-kernel gate `lower_bound · sigmoid(·)`.
    pub lower_bound: Option<f64>,
    /// States (`initial_state`, `final_state`, `dht`, `dh0`) are `[N, H, V, K]`.
    pub state_v_first: bool,
}

impl Gdn2Options {
    /// The query scale for key dimension `k`: `scale`, else `k^-0.5`.
    pub fn scale_for(&self, k: usize) -> f64 {
        self.scale.unwrap_or(1.0 / (k as f64).sqrt())
    }
}

/// `o [B, T, H, V]`, and `final_state` (state layout) when asked for.
#[derive(Clone, Debug)]
pub struct Gdn2Outputs<T> {
    pub o: ArrayD<T>,
    pub final_state: Option<ArrayD<T>>,
}

/// Gradients, each shaped like its input; `None` where the input was absent.
#[derive(Clone, Debug)]
pub struct Gdn2Grads<T> {
    pub dq: ArrayD<T>,
    pub dk: ArrayD<T>,
    pub dv: ArrayD<T>,
    /// With respect to `g` as passed (the raw input with `use_gate_in_kernel`).
    pub dg: ArrayD<T>,
    pub db: ArrayD<T>,
    pub dw: ArrayD<T>,
    pub da_log: Option<ArrayD<T>>,
    pub ddt_bias: Option<ArrayD<T>>,
    /// In the state layout of the options.
    pub dh0: Option<ArrayD<T>>,
}

impl<T: Scalar> Gdn2Head<'_, T> {
    /// Tokens `L`.
    pub fn len(&self) -> usize {
        self.q.nrows()
    }
    /// No tokens (an empty sequence, or a CP piece of none).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `K`
    pub fn k_dim(&self) -> usize {
        self.q.ncols()
    }
    /// `V`
    pub fn v_dim(&self) -> usize {
        self.v.ncols()
    }
}

impl<T: Scalar> Gdn2HeadGrads<T> {
    /// Zero gradients of an `L`-token piece with a `[K, V]` state.
    pub fn zeros(l: usize, k: usize, v: usize) -> Self {
        Gdn2HeadGrads {
            dq: Array2::zeros((l, k)),
            dk: Array2::zeros((l, k)),
            dv: Array2::zeros((l, v)),
            dg: Array2::zeros((l, k)),
            db: Array2::zeros((l, k)),
            dw: Array2::zeros((l, v)),
            dh0: Array2::zeros((k, v)),
        }
    }
}

/// `a bᵀ` (`a [m]`, `b [n]`; returns `[m, n]`).
fn outer<T: Scalar>(a: ArrayView1<T>, b: ArrayView1<T>) -> Array2<T> {
    &a.insert_axis(Axis(1)) * &b.insert_axis(Axis(0))
}

/// `Diag(d) a` in place: row `i` of `a [m, n]` times `d[i]` (`d [m]`).
fn scale_rows<T: Scalar>(a: &mut Array2<T>, d: ArrayView1<T>) {
    *a *= &d.insert_axis(Axis(1));
}

/// FLA's softplus threshold: above it `softplus(x) = x` (torch's
/// `F.softplus` default and FLA's `fla/ops/utils/softplus.py`).
pub(crate) const SOFTPLUS_THRESHOLD: f64 = 20.0;

/// One element of `chunk_gdn2`'s in-kernel gate (`kda_gate_chunk_cumsum`):
/// `x = g + dt_bias`, `a_log` the head's `A_log`. Returns the decay and its
/// partial derivatives `(g, ∂g/∂x, ∂g/∂A_log)`. The bounded form is
/// [`Gate::LowerBound`]'s exactly; the softplus form is [`Gate::Kda`]'s
/// below FLA's threshold and `−exp(A_log)·x` above it, with that line's
/// own derivatives (torch's autograd of FLA's naive gate; FLA's Triton
/// backward keeps `sigmoid(x)`, which differs by < 2.1e-9 relative).
/// Validation guarantees `A_log` for the softplus form.
fn gate_element<T: Scalar>(lower_bound: Option<f64>, x: T, a_log: Option<T>) -> (T, T, T) {
    match lower_bound {
        Some(lower_bound) => Gate::LowerBound { lower_bound }.eval(x, a_log),
        None if x > T::c(SOFTPLUS_THRESHOLD) => {
            let a = a_log
                .expect("validated: the softplus gate needs A_log")
                .exp();
            (-a * x, -a, -a * x)
        }
        None => Gate::Kda.eval(x, a_log),
    }
}

/// `f(gate_element(g + dt_bias, A_log))` for every element of the raw
/// `g [B, T, H, K]` (validated shapes), element by element.
fn map_gate<T: Scalar, U>(
    x: &Gdn2Inputs<T>,
    opt: &Gdn2Options,
    f: impl Fn((T, T, T)) -> U,
) -> ndarray::Array4<U> {
    let g = tensor::view4(&x.g);
    let kd = g.dim().3;
    let a_log = x
        .a_log
        .as_ref()
        .map(|a| a.iter().copied().collect::<Vec<T>>());
    let bias = x
        .dt_bias
        .as_ref()
        .map(|d| d.iter().copied().collect::<Vec<T>>());
    Array4::from_shape_fn(g.dim(), |(bi, ti, h, j)| {
        let shift = bias.as_ref().map_or(T::zero(), |d| d[h * kd + j]);
        f(gate_element(
            opt.lower_bound,
            g[[bi, ti, h, j]] + shift,
            a_log.as_ref().map(|a| a[h]),
        ))
    })
}

impl<T: Scalar> Gdn2Inputs<T> {
    /// Validates inputs and options; returns the problem sizes. Every refusal
    /// names the tensor (or option), the expected shape and what it got.
    pub fn validate(&self, opt: &Gdn2Options) -> Result<Gdn2Dims> {
        Ok(checked(self, opt)?.0)
    }
}

/// [`Gdn2Inputs::validate`], also returning the in-kernel gate's decay `[B, T, H, K]`
/// (checked finite) when `use_gate_in_kernel` is on.
fn checked<T: Scalar>(
    x: &Gdn2Inputs<T>,
    opt: &Gdn2Options,
) -> Result<(Gdn2Dims, Option<Array4<T>>)> {
    let qs = expect_rank("q", "B,T,H,K", &x.q)?;
    let (b, t, h, k) = (qs[0], qs[1], qs[2], qs[3]);
    if h == 0 || k == 0 {
        return Err(Error::shape("q", "[B,T,H,K] with H ≥ 1 and K ≥ 1", qs));
    }
    for (name, a) in [("k", &x.k), ("g", &x.g), ("b", &x.b)] {
        expect_shape(name, "[B,T,H,K] (as q)", qs, a.shape())?;
    }
    let vs = expect_rank("v", "B,T,H,V", &x.v)?;
    let v = vs[3];
    if vs[..3] != qs[..3] || v == 0 {
        return Err(Error::shape(
            "v",
            format!(
                "[B,T,H,V] with B, T, H = {:?} as q (chunk_gdn2 has no GVA) and V ≥ 1",
                &qs[..3]
            ),
            vs,
        ));
    }
    expect_shape("w", "[B,T,H,V] (as v)", vs, x.w.shape())?;
    let n = varlen::sequences(b, t, x.cu_seqlens.as_deref())?.len();
    if let Some(h0) = &x.initial_state {
        let (dims, want) = if opt.state_v_first {
            ("[N,H,V,K] (state_v_first)", [n, h, v, k])
        } else {
            ("[N,H,K,V]", [n, h, k, v])
        };
        expect_shape("initial_state", dims, &want, h0.shape())?;
    }
    if let Some(sc) = opt.scale {
        check_finite_option("scale", sc)?;
    }
    validate_gate(x, opt, h, k)?;
    for (name, a) in [
        ("q", &x.q),
        ("k", &x.k),
        ("v", &x.v),
        ("g", &x.g),
        ("b", &x.b),
        ("w", &x.w),
    ] {
        check_finite(name, a)?;
    }
    for (name, a) in [
        ("A_log", &x.a_log),
        ("dt_bias", &x.dt_bias),
        ("initial_state", &x.initial_state),
    ] {
        if let Some(a) = a {
            check_finite(name, a)?;
        }
    }
    let decay = if opt.use_gate_in_kernel {
        // Finite parameters can still give a non-finite decay (a huge A_log).
        let g = map_gate(x, opt, |(g, _, _)| g);
        check_finite("g", &g.clone().into_dyn())?;
        Some(g)
    } else {
        None
    };
    Ok((Gdn2Dims { b, t, h, k, v, n }, decay))
}

/// The gate options and parameters: FLA's checks in `chunk_gdn2`, and ours
/// against silently ignored inputs.
fn validate_gate<T: Scalar>(
    x: &Gdn2Inputs<T>,
    opt: &Gdn2Options,
    h: usize,
    k: usize,
) -> Result<()> {
    if let Some(lb) = opt.lower_bound {
        check_finite_option("lower_bound", lb)?;
    }
    if !opt.use_gate_in_kernel {
        if x.a_log.is_some() || x.dt_bias.is_some() {
            return Err(Error::option(
                "use_gate_in_kernel",
                "A_log/dt_bias were given but use_gate_in_kernel is false (g is already the decay)",
            ));
        }
        if opt.lower_bound.is_some() {
            return Err(Error::option(
                "lower_bound",
                "only the in-kernel gate reads it, and use_gate_in_kernel is false",
            ));
        }
        return Ok(());
    }
    if x.a_log.is_none() && opt.lower_bound.is_none() {
        return Err(Error::missing(
            "A_log",
            "use_gate_in_kernel without lower_bound computes −exp(A_log)·softplus(g + dt_bias): A_log [H] is required",
        ));
    }
    if opt.safe_gate {
        match opt.lower_bound {
            None => {
                return Err(Error::option(
                    "lower_bound",
                    "safe_gate with use_gate_in_kernel needs lower_bound in [−5, 0)",
                ))
            }
            Some(lb) if !(-5.0..0.0).contains(&lb) => {
                return Err(Error::option(
                    "lower_bound",
                    format!("safe_gate needs lower_bound in [−5, 0), got {lb}"),
                ))
            }
            Some(_) => {}
        }
    }
    if let Some(a) = &x.a_log {
        expect_shape("A_log", "[H]", &[h], a.shape())?;
    }
    if let Some(d) = &x.dt_bias {
        expect_shape("dt_bias", "[H*K]", &[h * k], d.shape())?;
    }
    Ok(())
}

/// Validates the upstream gradients `do [B, T, H, V]` and `dht` (`[N, H, K,
/// V]`, or `[N, H, V, K]` with `state_v_first`) against validated sizes `d`.
pub(crate) fn validate_upstream<T: Scalar>(
    d: &Gdn2Dims,
    state_v_first: bool,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<()> {
    expect_finite("do", "[B,T,H,V]", &[d.b, d.t, d.h, d.v], d_o)?;
    if let Some(dht) = dht {
        let (dims, want) = if state_v_first {
            ("[N,H,V,K] (state_v_first)", [d.n, d.h, d.v, d.k])
        } else {
            ("[N,H,K,V]", [d.n, d.h, d.k, d.v])
        };
        expect_finite("dht", dims, &want, dht)?;
    }
    Ok(())
}

/// `[N, H, a, b]` → `[N, H, b, a]`: the `state_v_first` layout swap (its own
/// inverse).
pub(crate) fn swap_state<T: Scalar>(s: &ArrayD<T>) -> ArrayD<T> {
    let mut t = s.view();
    t.swap_axes(2, 3);
    t.as_standard_layout().into_owned()
}

impl<'a, T: Scalar> Prepared<'a, T> {
    /// Validates `x` and applies l2norm and the in-kernel gate.
    pub fn new(x: &'a Gdn2Inputs<T>, opt: &Gdn2Options) -> Result<Self> {
        let (dims, decay) = checked(x, opt)?;
        let l2 = |a: &'a ArrayD<T>| match opt.use_qk_l2norm_in_kernel {
            true => CowArray::from(gates::l2norm_fwd(&tensor::view4(a))),
            false => CowArray::from(tensor::view4(a)),
        };
        let h0 = x.initial_state.as_ref().map(|s| match opt.state_v_first {
            true => CowArray::from(tensor::to4(&swap_state(s))),
            false => CowArray::from(tensor::view4(s)),
        });
        Ok(Prepared {
            dims,
            scale: opt.scale_for(dims.k),
            segments: varlen::sequences(dims.b, dims.t, x.cu_seqlens.as_deref())?,
            q: l2(&x.q),
            k: l2(&x.k),
            v: tensor::view4(&x.v),
            g: decay.map_or_else(|| CowArray::from(tensor::view4(&x.g)), CowArray::from),
            b: tensor::view4(&x.b),
            w: tensor::view4(&x.w),
            h0,
            state_v_first: opt.state_v_first,
            l2norm: opt.use_qk_l2norm_in_kernel,
        })
    }

    /// q and k after the in-kernel l2norm rounded per `policy`'s
    /// [`Stage::Activations`] storage, as FLA's `l2norm_fwd` writes them (in
    /// the input dtype) for the kernels to read back; unchanged without it.
    pub fn with_stored_activations(mut self, policy: &Policy) -> Self {
        let Some(s) = policy.storage(Stage::Activations) else {
            return self;
        };
        if self.l2norm {
            self.q = CowArray::from(self.q.mapv(|x| s.round(x)));
            self.k = CowArray::from(self.k.mapv(|x| s.round(x)));
        }
        self
    }
}

impl<T: Scalar> op::Prepared<T> for Prepared<'_, T> {
    fn shape(&self) -> Shape {
        let d = self.dims;
        Shape {
            b: d.b,
            t: d.t,
            n: d.n,
            heads: d.h,
            k: d.k,
            v: d.v,
        }
    }

    fn segments(&self) -> &[Segment] {
        &self.segments
    }

    fn h0(&self) -> Option<ArrayView4<'_, T>> {
        self.h0.as_ref().map(|h| h.view())
    }
}

/// The public gradients from per-piece gradients: assembled, then chained
/// through `scale`, l2norm, the in-kernel gate and the state layout.
fn chain<T: Scalar>(
    x: &Gdn2Inputs<T>,
    opt: &Gdn2Options,
    p: &Prepared<'_, T>,
    pieces: Vec<(Segment, usize, Gdn2HeadGrads<T>)>,
    dh0: Array4<T>,
) -> Gdn2Grads<T> {
    let d = p.dims;
    let mut blocks: [Vec<(Segment, usize, Array2<T>)>; 6] = Default::default();
    for (seg, h, g) in pieces {
        for (list, a) in blocks.iter_mut().zip([g.dq, g.dk, g.dv, g.dg, g.db, g.dw]) {
            list.push((seg, h, a));
        }
    }
    let [dq, dk, dv, dg, db, dw] = blocks;
    let tokens = |b, width| tensor::assemble((d.b, d.t, d.h, width), b);
    let (mut dq, mut dk) = (tokens(dq, d.k), tokens(dk, d.k));
    // The engines saw `scale · q`.
    dq.mapv_inplace(|e| e * T::c(p.scale));
    if opt.use_qk_l2norm_in_kernel {
        dq = gates::l2norm_bwd(&tensor::view4(&x.q), &dq);
        dk = gates::l2norm_bwd(&tensor::view4(&x.k), &dk);
    }
    let (dg, da_log, ddt_bias) = gate_backward(x, opt, &d, tokens(dg, d.k));
    let dh0 = dh0.into_dyn();
    Gdn2Grads {
        dq: dq.into_dyn(),
        dk: dk.into_dyn(),
        dv: tokens(dv, d.v).into_dyn(),
        dg,
        db: tokens(db, d.k).into_dyn(),
        dw: tokens(dw, d.v).into_dyn(),
        da_log,
        ddt_bias,
        dh0: x.initial_state.as_ref().map(|_| match opt.state_v_first {
            true => swap_state(&dh0),
            false => dh0,
        }),
    }
}

/// `(dg shaped like x.g, dA_log, ddt_bias)` from the decay gradient
/// `[B, T, H, K]`: FLA's `kda_gate_bwd` when the gate ran in the kernel.
fn gate_backward<T: Scalar>(
    x: &Gdn2Inputs<T>,
    opt: &Gdn2Options,
    d: &Gdn2Dims,
    ddecay: Array4<T>,
) -> (ArrayD<T>, Option<ArrayD<T>>, Option<ArrayD<T>>) {
    if !opt.use_gate_in_kernel {
        return (ddecay.into_dyn(), None, None);
    }
    let partials = map_gate(x, opt, |(_, dx, da)| (dx, da));
    let dg = Zip::from(&ddecay)
        .and(&partials)
        .map_collect(|&dd, &(dx, _)| dd * dx);
    // Serial sums in index order: the bits do not depend on the threads.
    let da_log = x.a_log.as_ref().map(|a| {
        let per_head = Array1::from_shape_fn(d.h, |h| {
            let mut sum = T::zero();
            Zip::from(ddecay.slice(s![.., .., h, ..]))
                .and(partials.slice(s![.., .., h, ..]))
                .for_each(|&dd, &(_, da)| sum += dd * da);
            sum
        });
        per_head
            .into_shape_with_order(IxDyn(a.shape()))
            .expect("A_log is [H]")
    });
    let ddt_bias = x.dt_bias.as_ref().map(|a| {
        let per_channel = dg.sum_axis(Axis(0)).sum_axis(Axis(0));
        per_channel
            .into_shape_with_order(IxDyn(a.shape()))
            .expect("dt_bias is [H*K]")
    });
    (dg.into_dyn(), da_log, ddt_bias)
}

/// GDN-2, FLA's `chunk_gdn2` / `naive_recurrent_gdn2`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gdn2;

impl OpSpec for Gdn2 {
    const NAME: &'static str = "gdn2";
    const INPUTS: &'static [&'static str] = &[
        "q",
        "k",
        "v",
        "g",
        "b",
        "w",
        "A_log",
        "dt_bias",
        "initial_state",
        "cu_seqlens",
    ];
    const OUTPUTS: &'static [&'static str] = &["o", "final_state"];
    const UPSTREAM: &'static [&'static str] = &["do", "dht"];
    const GRADS: &'static [&'static str] = &[
        "dq", "dk", "dv", "dg", "db", "dw", "dA_log", "ddt_bias", "dh0",
    ];
    type Options = Gdn2Options;

    fn all_outputs(opt: &Gdn2Options) -> Gdn2Options {
        Gdn2Options {
            output_final_state: true,
            ..*opt
        }
    }
}

impl<T: Scalar> Operator<T> for Gdn2 {
    type Inputs = Gdn2Inputs<T>;
    type Outputs = Gdn2Outputs<T>;
    type Grads = Gdn2Grads<T>;
    type Head<'h> = Gdn2Head<'h, T>;
    type HeadGrads = Gdn2HeadGrads<T>;
    type Prepared<'a>
        = Prepared<'a, T>
    where
        T: 'a;

    fn prepare<'a>(x: &'a Gdn2Inputs<T>, opt: &Gdn2Options) -> Result<Prepared<'a, T>> {
        Prepared::new(x, opt)
    }

    /// Head `h` of `seg`: borrowed rows, the query scaled into a copy.
    fn head<'p>(p: &'p Prepared<'_, T>, seg: &Segment, h: usize) -> Gdn2Head<'p, T> {
        let rows = |a: ArrayView4<'p, T>| CowArray::from(tensor::head_view(a, seg, h));
        let scale = T::c(p.scale);
        Gdn2Head {
            q: CowArray::from(tensor::head_view(p.q.view(), seg, h).mapv(|e| e * scale)),
            k: rows(p.k.view()),
            v: rows(p.v),
            g: rows(p.g.view()),
            b: rows(p.b),
            w: rows(p.w),
        }
    }

    /// `Σ_t g[t, h, :]` over `seg`: the per-channel log-decay after the gate (`[K]`).
    fn decay_log_sum(p: &Prepared<'_, T>, seg: &Segment, h: usize) -> Option<ndarray::Array1<T>> {
        Some(tensor::head_view(p.g.view(), seg, h).sum_axis(ndarray::Axis(0)))
    }

    fn cu_seqlens(x: &Gdn2Inputs<T>) -> Option<&[i64]> {
        x.cu_seqlens.as_deref()
    }

    fn validate_upstream(
        p: &Prepared<'_, T>,
        d_o: &ArrayD<T>,
        dht: Option<&ArrayD<T>>,
    ) -> Result<()> {
        validate_upstream(&p.dims, p.state_v_first, d_o, dht)
    }

    fn dht_view<'d>(opt: &Gdn2Options, dht: &'d ArrayD<T>) -> ArrayView4<'d, T> {
        let mut v = tensor::view4(dht);
        if opt.state_v_first {
            v.swap_axes(2, 3);
        }
        v
    }

    /// The piece with `v` and `w` replaced by `K` zero columns: the state
    /// recurrence alone.
    fn probe<'h>(x: &Self::Head<'h>) -> (Self::Head<'h>, usize) {
        let (l, kd) = (x.len(), x.k_dim());
        let probe = Gdn2Head {
            v: CowArray::from(Array2::zeros((l, kd))),
            w: CowArray::from(Array2::zeros((l, kd))),
            ..x.clone()
        };
        (probe, kd)
    }

    fn outputs(opt: &Gdn2Options, o: Array4<T>, final_state: Array4<T>) -> Gdn2Outputs<T> {
        Gdn2Outputs {
            o: o.into_dyn(),
            final_state: opt.output_final_state.then(|| {
                let s = final_state.into_dyn();
                match opt.state_v_first {
                    true => swap_state(&s),
                    false => s,
                }
            }),
        }
    }

    fn grads(
        x: &Gdn2Inputs<T>,
        opt: &Gdn2Options,
        p: &Prepared<'_, T>,
        pieces: Vec<(Segment, usize, Gdn2HeadGrads<T>)>,
        dh0: Array4<T>,
    ) -> Gdn2Grads<T> {
        chain(x, opt, p, pieces, dh0)
    }

    fn output_tensors(out: &Gdn2Outputs<T>) -> Vec<Option<&ArrayD<T>>> {
        vec![Some(&out.o), out.final_state.as_ref()]
    }

    fn grad_tensors(gr: &Gdn2Grads<T>) -> Vec<Option<&ArrayD<T>>> {
        vec![
            Some(&gr.dq),
            Some(&gr.dk),
            Some(&gr.dv),
            Some(&gr.dg),
            Some(&gr.db),
            Some(&gr.dw),
            gr.da_log.as_ref(),
            gr.ddt_bias.as_ref(),
            gr.dh0.as_ref(),
        ]
    }

    fn head_dh0(g: &Gdn2HeadGrads<T>) -> &Array2<T> {
        &g.dh0
    }

    crate::grads_collected!();

    fn narrow(x: &Gdn2Inputs<f64>) -> Gdn2Inputs<T> {
        x.cast()
    }
}
