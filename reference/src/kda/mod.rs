//! KDA (Kimi Delta Attention), SPEC §3:
//! `S_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ`, `o_t = S_tᵀ (scale·q_t)`.
//!
//! This module owns what every form shares: the public tensors and options,
//! validation, the pre-processing FLA fuses into its kernels (l2norm, scale,
//! gate, beta sigmoid) and its backward, and [`Kda`], its side of the
//! operator contract ([`crate::op`]). The engines (`naive`, `chunk`) only see
//! one head of one sequence.

pub(crate) mod chunk;
// The registry entry, listed in `registry::OPS`: tools reach it only there.
pub(crate) mod entry;
mod intermediates;
pub(crate) mod naive;

// The engine pieces: public types without a public path (see the module).
mod pieces;
pub(crate) mod spec;

// The engines, named from here: the forms' modules hold their pieces.
pub use chunk::Chunk;
pub use naive::Naive;

use ndarray::{
    s, Array1, Array2, Array3, Array4, ArrayD, ArrayView4, ArrayViewMut1, ArrayViewMut2, Axis,
    CowArray, Ix1, Ix2, Ix3, Ix4, IxDyn,
};

use crate::error::{Error, Result};
use crate::fast::views;
use crate::gates::{self, Gate};
use crate::op::{self, OpSpec, Operator, Shape};
use crate::precision::{Policy, Stage};
use crate::scalar::Scalar;
use crate::tensor::{
    self, check_finite, check_finite_option, expect_finite, expect_rank, expect_shape,
};
use crate::varlen::{self, Segment};

pub(crate) use pieces::{KdaHead, KdaHeadGrads, KdaHeadGradsMut, Prepared, PreparedGrads};

/// KDA inputs in FLA's layout (see SPEC §2).
#[derive(Clone, Debug)]
pub struct KdaInputs<T> {
    /// `[B, T, H, K]`
    pub q: ArrayD<T>,
    /// `[B, T, H, K]`
    pub k: ArrayD<T>,
    /// `[B, T, HV, V]`, HV a multiple of H (GVA)
    pub v: ArrayD<T>,
    /// `[B, T, HV, K]` log-space decay (or the raw gate input with a gate
    /// option); `[B, T, HV]` for one scalar gate per head (GDN).
    pub g: ArrayD<T>,
    /// `[B, T, HV]` (a logit with `use_beta_sigmoid_in_kernel`)
    pub beta: ArrayD<T>,
    /// `[HV]`, used by the in-kernel gates
    pub a_log: Option<ArrayD<T>>,
    /// `[HV * K]` (`[HV]` for GDN), used by the in-kernel gates
    pub dt_bias: Option<ArrayD<T>>,
    /// `[N, HV, K, V]`
    pub initial_state: Option<ArrayD<T>>,
    /// `[N + 1]`, varlen mode (B = 1)
    pub cu_seqlens: Option<Vec<i64>>,
}

impl<T: Scalar> KdaInputs<T> {
    /// The same inputs in another scalar (e.g. f64 → f32 to study f32 rounding).
    pub fn cast<U: Scalar>(&self) -> KdaInputs<U> {
        KdaInputs {
            q: tensor::cast(&self.q),
            k: tensor::cast(&self.k),
            v: tensor::cast(&self.v),
            g: tensor::cast(&self.g),
            beta: tensor::cast(&self.beta),
            a_log: tensor::cast_opt(&self.a_log),
            dt_bias: tensor::cast_opt(&self.dt_bias),
            initial_state: tensor::cast_opt(&self.initial_state),
            cu_seqlens: self.cu_seqlens.clone(),
        }
    }
}

/// KDA inputs borrowed where they live (a case file's tensors): what
/// validation and the GPU upload read, without copying a tensor. Shapes as
/// in [`KdaInputs`].
#[derive(Clone, Copy, Debug)]
pub struct KdaRefs<'a, T> {
    pub q: &'a ArrayD<T>,
    pub k: &'a ArrayD<T>,
    pub v: &'a ArrayD<T>,
    pub g: &'a ArrayD<T>,
    pub beta: &'a ArrayD<T>,
    pub a_log: Option<&'a ArrayD<T>>,
    pub dt_bias: Option<&'a ArrayD<T>>,
    pub initial_state: Option<&'a ArrayD<T>>,
    pub cu_seqlens: Option<&'a [i64]>,
}

impl<T> KdaInputs<T> {
    /// The inputs borrowed.
    pub fn refs(&self) -> KdaRefs<'_, T> {
        KdaRefs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
            a_log: self.a_log.as_ref(),
            dt_bias: self.dt_bias.as_ref(),
            initial_state: self.initial_state.as_ref(),
            cu_seqlens: self.cu_seqlens.as_deref(),
        }
    }
}

/// FLA `chunk_kda` options (names as in FLA).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct KdaOptions {
    /// Defaults to `K^-0.5`.
    pub scale: Option<f64>,
    pub output_final_state: bool,
    pub use_qk_l2norm_in_kernel: bool,
    /// `use_gate_in_kernel` and `lower_bound` together.
    pub gate: Gate,
    pub use_beta_sigmoid_in_kernel: bool,
    pub allow_neg_eigval: bool,
}

impl KdaOptions {
    /// The query scale for key dimension `k`: `scale`, else `k^-0.5`.
    pub fn scale_for(&self, k: usize) -> f64 {
        self.scale.unwrap_or(1.0 / (k as f64).sqrt())
    }
}

/// `o [B, T, HV, V]`, `final_state [N, HV, K, V]` when asked for.
#[derive(Clone, Debug)]
pub struct KdaOutputs<T> {
    pub o: ArrayD<T>,
    pub final_state: Option<ArrayD<T>>,
}

/// Gradients, each shaped like its input; `None` where the input was absent.
#[derive(Clone, Debug)]
pub struct KdaGrads<T> {
    pub dq: ArrayD<T>,
    pub dk: ArrayD<T>,
    pub dv: ArrayD<T>,
    pub dg: ArrayD<T>,
    pub dbeta: ArrayD<T>,
    pub da_log: Option<ArrayD<T>>,
    pub ddt_bias: Option<ArrayD<T>>,
    pub dh0: Option<ArrayD<T>>,
}

/// Sizes of a validated KDA problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KdaDims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub hv: usize,
    pub k: usize,
    pub v: usize,
    /// Number of sequences.
    pub n: usize,
    /// `g` is `[B, T, HV]` (one scalar gate per head, GDN).
    pub scalar_gate: bool,
}

impl KdaDims {
    /// Heads that carry a state (value heads).
    pub fn heads(&self) -> usize {
        self.hv
    }

    /// Value heads per q/k head.
    pub fn groups(&self) -> usize {
        self.hv / self.h
    }
}

impl<T: Scalar> KdaHead<'_, T> {
    /// The head with its own copy of any borrowed tensor.
    pub fn into_owned(self) -> KdaHead<'static, T> {
        KdaHead {
            q: self.q.into_owned().into(),
            k: self.k.into_owned().into(),
            v: self.v.into_owned().into(),
            g: self.g.into_owned().into(),
            beta: self.beta.into_owned().into(),
            scale: self.scale,
        }
    }

    /// The head in standard layout with `scale` applied to `q` (`scale`
    /// 1), borrowing what already is so: what the chunked engine indexes.
    pub fn standard<'a>(&'a self) -> KdaHead<'a, T> {
        self.standard_rows(0..self.len())
    }

    /// Rows `r` of [`KdaHead::standard`] (tokens `r` of the pair), copying
    /// only those rows where a copy is needed.
    pub fn standard_rows<'a>(&'a self, r: std::ops::Range<usize>) -> KdaHead<'a, T> {
        let rows = |a: &'a CowArray<'_, T, Ix2>| views::standard(a.slice(s![r.clone(), ..]));
        KdaHead {
            q: views::scaled_standard(self.q.slice(s![r.clone(), ..]), self.scale),
            k: rows(&self.k),
            v: rows(&self.v),
            g: rows(&self.g),
            beta: views::standard(self.beta.slice(s![r])),
            scale: T::one(),
        }
    }

    pub fn len(&self) -> usize {
        self.q.nrows()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn k_dim(&self) -> usize {
        self.q.ncols()
    }
    pub fn v_dim(&self) -> usize {
        self.v.ncols()
    }
}

impl<T: Scalar> KdaHeadGrads<T> {
    /// Zero gradients of an `L`-token piece with a `[K, V]` state.
    pub fn zeros(l: usize, k: usize, v: usize) -> Self {
        KdaHeadGrads {
            dq: Array2::zeros((l, k)),
            dk: Array2::zeros((l, k)),
            dv: Array2::zeros((l, v)),
            dg: Array2::zeros((l, k)),
            dbeta: Array1::zeros(l),
            dh0: Array2::zeros((k, v)),
        }
    }

    pub fn view_mut(&mut self) -> KdaHeadGradsMut<'_, T> {
        KdaHeadGradsMut {
            dq: self.dq.view_mut(),
            dk: self.dk.view_mut(),
            dv: self.dv.view_mut(),
            dg: self.dg.view_mut(),
            dbeta: self.dbeta.view_mut(),
            dh0: self.dh0.view_mut(),
        }
    }
}

impl<T: Scalar> KdaHeadGradsMut<'_, T> {
    /// The gradients of tokens `r` (`[r.len(), ·]` views of these), with
    /// `dh0` written into `dh0` instead: the state gradient at `r.start`.
    pub fn rows_mut<'a>(
        &'a mut self,
        r: std::ops::Range<usize>,
        dh0: ArrayViewMut2<'a, T>,
    ) -> KdaHeadGradsMut<'a, T> {
        let rows = |a: &'a mut ArrayViewMut2<'_, T>| a.slice_mut(s![r.clone(), ..]);
        KdaHeadGradsMut {
            dq: rows(&mut self.dq),
            dk: rows(&mut self.dk),
            dv: rows(&mut self.dv),
            dg: rows(&mut self.dg),
            dbeta: self.dbeta.slice_mut(s![r]),
            dh0,
        }
    }

    /// Writes `g` here.
    pub fn assign(self, g: &KdaHeadGrads<T>) {
        views::copy_into(self.dq, g.dq.view());
        views::copy_into(self.dk, g.dk.view());
        views::copy_into(self.dv, g.dv.view());
        views::copy_into(self.dg, g.dg.view());
        views::copy_into(self.dbeta, g.dbeta.view());
        views::copy_into(self.dh0, g.dh0.view());
    }
}

impl<T: Scalar> KdaRefs<'_, T> {
    /// Validates borrowed inputs and options; returns the problem sizes.
    pub fn validate(&self, opt: &KdaOptions) -> Result<KdaDims> {
        let x = self;
        let qs = expect_rank("q", "B,T,H,K", x.q)?;
        let (b, t, h, k) = (qs[0], qs[1], qs[2], qs[3]);
        if h == 0 || k == 0 {
            return Err(Error::shape("q", "[B,T,H,K] with H ≥ 1 and K ≥ 1", qs));
        }
        expect_shape("k", "[B,T,H,K]", qs, x.k.shape())?;
        let vs = expect_rank("v", "B,T,HV,V", x.v)?;
        let (hv, v) = (vs[2], vs[3]);
        expect_shape(
            "v",
            "[B,T,HV,V] (B, T as q)",
            &[b, t, hv, v],
            &[vs[0], vs[1], hv, v],
        )?;
        if hv == 0 || hv % h != 0 || v == 0 {
            return Err(Error::shape(
                "v",
                format!("[B,T,HV,V] with HV a positive multiple of H = {h} (GVA) and V ≥ 1"),
                vs,
            ));
        }
        let scalar_gate = x.g.ndim() == 3;
        if scalar_gate {
            expect_shape(
                "g",
                "[B,T,HV] (scalar gate per head)",
                &[b, t, hv],
                x.g.shape(),
            )?;
        } else {
            expect_shape(
                "g",
                "[B,T,HV,K] (or [B,T,HV] for a scalar gate)",
                &[b, t, hv, k],
                x.g.shape(),
            )?;
        }
        expect_shape("beta", "[B,T,HV]", &[b, t, hv], x.beta.shape())?;

        let segments = varlen::sequences(b, t, x.cu_seqlens)?;
        let n = segments.len();
        if let Some(h0) = &x.initial_state {
            expect_shape("initial_state", "[N,HV,K,V]", &[n, hv, k, v], h0.shape())?;
        }
        validate_gate(x, opt, hv, k, scalar_gate)?;
        if let Some(sc) = opt.scale {
            check_finite_option("scale", sc)?;
        }
        if opt.allow_neg_eigval && !opt.use_beta_sigmoid_in_kernel {
            return Err(Error::option(
                "allow_neg_eigval",
                "only takes effect with use_beta_sigmoid_in_kernel (β = 2·sigmoid(beta))",
            ));
        }
        for (name, t) in [
            ("q", &x.q),
            ("k", &x.k),
            ("v", &x.v),
            ("g", &x.g),
            ("beta", &x.beta),
        ] {
            check_finite(name, t)?;
        }
        for (name, t) in [
            ("A_log", &x.a_log),
            ("dt_bias", &x.dt_bias),
            ("initial_state", &x.initial_state),
        ] {
            if let Some(t) = t {
                check_finite(name, t)?;
            }
        }
        Ok(KdaDims {
            b,
            t,
            h,
            hv,
            k,
            v,
            n,
            scalar_gate,
        })
    }
}

fn validate_gate<T: Scalar>(
    x: &KdaRefs<'_, T>,
    opt: &KdaOptions,
    hv: usize,
    k: usize,
    scalar_gate: bool,
) -> Result<()> {
    match opt.gate {
        Gate::None => {
            if x.a_log.is_some() || x.dt_bias.is_some() {
                return Err(Error::option(
                    "gate",
                    "A_log/dt_bias were given but no in-kernel gate is selected (gate = none)",
                ));
            }
            return Ok(());
        }
        Gate::Kda if x.a_log.is_none() => {
            return Err(Error::missing(
                "A_log",
                "the kda gate −exp(A_log)·softplus(g + dt_bias) needs A_log [HV]",
            ));
        }
        Gate::LowerBound { lower_bound } => {
            check_finite_option("lower_bound", lower_bound)?;
            if lower_bound >= 0.0 {
                return Err(Error::option(
                    "lower_bound",
                    format!("must be negative (log-space decay), got {lower_bound}"),
                ));
            }
        }
        Gate::Kda => {}
    }
    if scalar_gate {
        return Err(Error::option(
            "gate",
            "in-kernel gates need a per-dimension g [B,T,HV,K]",
        ));
    }
    if let Some(a) = &x.a_log {
        expect_shape("A_log", "[HV]", &[hv], a.shape())?;
    }
    if let Some(d) = &x.dt_bias {
        expect_shape("dt_bias", "[HV*K]", &[hv * k], d.shape())?;
    }
    Ok(())
}

impl<'a, T: Scalar> Prepared<'a, T> {
    /// The activations' outputs (q/k after an in-kernel l2norm) rounded per
    /// `policy`'s [`Stage::Activations`] storage, as a kernel that writes them
    /// to memory reads them back. β after the in-kernel sigmoid is not:
    /// FLA's `fused_beta_sigmoid` writes fp32.
    pub fn with_stored_activations(mut self, policy: &Policy) -> Self {
        let Some(s) = policy.store(Stage::Activations) else {
            return self;
        };
        if self.opt.use_qk_l2norm_in_kernel {
            self.q = CowArray::from(self.q.mapv(|x| s.round(x)));
            self.k = CowArray::from(self.k.mapv(|x| s.round(x)));
        }
        self
    }

    /// Validates `x` and applies l2norm, scale, gate and beta sigmoid.
    pub fn new(x: &'a KdaInputs<T>, opt: &KdaOptions) -> Result<Self> {
        let x = &x.refs();
        let dims = x.validate(opt)?;
        let segments = varlen::sequences(dims.b, dims.t, x.cu_seqlens)?;
        let Activations { q, k, beta } = Activations::new(x, opt);
        Ok(Prepared {
            dims,
            scale: opt.scale_for(dims.k),
            segments,
            q,
            k,
            v: tensor::view4(x.v),
            g: gate_terms(x, opt, &dims, false).0,
            beta,
            h0: x.initial_state.map(tensor::view4),
            opt: *opt,
        })
    }
}

/// The in-kernel activations of validated inputs: `q`, `k` `[B, T, H, K]`
/// (l2-normalised if asked, else views of the inputs) and β `[B, T, HV]`
/// (after the sigmoid if asked). GDN's are KDA's.
pub(crate) struct Activations<'a, T> {
    pub q: CowArray<'a, T, Ix4>,
    pub k: CowArray<'a, T, Ix4>,
    pub beta: Array3<T>,
}

impl<'a, T: Scalar> Activations<'a, T> {
    pub fn new(x: &KdaRefs<'a, T>, opt: &KdaOptions) -> Self {
        let (q, k) = (tensor::view4(x.q), tensor::view4(x.k));
        let (q, k) = if opt.use_qk_l2norm_in_kernel {
            let l2 = |x| CowArray::from(gates::l2norm_fwd(&x));
            (l2(q), l2(k))
        } else {
            (CowArray::from(q), CowArray::from(k))
        };
        let beta = x
            .beta
            .view()
            .into_dimensionality::<Ix3>()
            .expect("validated")
            .mapv(|b| {
                if opt.use_beta_sigmoid_in_kernel {
                    gates::beta_sigmoid(b, opt.allow_neg_eigval).0
                } else {
                    b
                }
            });
        Activations { q, k, beta }
    }
}

impl<T: Scalar> op::Prepared<T> for Prepared<'_, T> {
    fn shape(&self) -> Shape {
        let d = self.dims;
        Shape {
            b: d.b,
            t: d.t,
            n: d.n,
            heads: d.hv,
            k: d.k,
            v: d.v,
        }
    }

    fn segments(&self) -> &[Segment] {
        &self.segments
    }

    fn h0(&self) -> Option<ArrayView4<'_, T>> {
        self.h0.as_ref().map(|h0| h0.view())
    }
}

/// KDA, FLA's `chunk_kda` / `fused_recurrent_kda`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Kda;

impl OpSpec for Kda {
    const NAME: &'static str = "kda";
    const INPUTS: &'static [&'static str] = &[
        "q",
        "k",
        "v",
        "g",
        "beta",
        "A_log",
        "dt_bias",
        "initial_state",
        "cu_seqlens",
    ];
    const OUTPUTS: &'static [&'static str] = &["o", "final_state"];
    const UPSTREAM: &'static [&'static str] = &["do", "dht"];
    const GRADS: &'static [&'static str] =
        &["dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"];
    type Options = KdaOptions;

    fn all_outputs(opt: &KdaOptions) -> KdaOptions {
        KdaOptions {
            output_final_state: true,
            ..*opt
        }
    }
}

impl<T: Scalar> Operator<T> for Kda {
    type Inputs = KdaInputs<T>;
    type Outputs = KdaOutputs<T>;
    type Grads = KdaGrads<T>;
    type Head<'h> = KdaHead<'h, T>;
    type HeadGrads = KdaHeadGrads<T>;
    type Prepared<'a>
        = Prepared<'a, T>
    where
        T: 'a;

    fn prepare<'a>(x: &'a KdaInputs<T>, opt: &KdaOptions) -> Result<Prepared<'a, T>> {
        Prepared::new(x, opt)
    }

    /// Head `hv` of `seg`, borrowed: q/k come from q/k head `hv / G` (GVA).
    fn head<'p>(p: &'p Prepared<'_, T>, seg: &Segment, hv: usize) -> KdaHead<'p, T> {
        let hq = hv / p.dims.groups();
        KdaHead {
            q: tensor::head_view(p.q.view(), seg, hq).into(),
            k: tensor::head_view(p.k.view(), seg, hq).into(),
            v: tensor::head_view(p.v.view(), seg, hv).into(),
            g: tensor::head_view(p.g.view(), seg, hv).into(),
            beta: CowArray::from(p.beta.slice(s![seg.batch, seg.start..seg.end, hv])),
            scale: T::c(p.scale),
        }
    }

    /// `Σ_t g[t, hv, :]` over `seg`: `g` is the per-channel log-decay after the gate (`[K]`).
    fn decay_log_sum(p: &Prepared<'_, T>, seg: &Segment, h: usize) -> Option<ndarray::Array1<T>> {
        Some(tensor::head_view(p.g.view(), seg, h).sum_axis(ndarray::Axis(0)))
    }

    fn cu_seqlens(x: &KdaInputs<T>) -> Option<&[i64]> {
        x.cu_seqlens.as_deref()
    }

    fn validate_upstream(
        p: &Prepared<'_, T>,
        d_o: &ArrayD<T>,
        dht: Option<&ArrayD<T>>,
    ) -> Result<()> {
        p.dims.validate_upstream(d_o, dht)
    }

    fn probe<'h>(x: &Self::Head<'h>) -> (Self::Head<'h>, usize) {
        let kd = x.k_dim();
        let probe = KdaHead {
            v: CowArray::from(Array2::zeros((x.len(), kd))),
            ..x.clone()
        };
        (probe, kd)
    }

    fn outputs(opt: &KdaOptions, o: Array4<T>, final_state: Array4<T>) -> KdaOutputs<T> {
        KdaOutputs {
            o: o.into_dyn(),
            final_state: opt.output_final_state.then(|| final_state.into_dyn()),
        }
    }

    fn grads(
        x: &KdaInputs<T>,
        opt: &KdaOptions,
        p: &Prepared<'_, T>,
        pieces: Vec<(Segment, usize, KdaHeadGrads<T>)>,
        dh0: Array4<T>,
    ) -> KdaGrads<T> {
        PreparedGrads::from_pieces(&p.dims, pieces, dh0).chain(&x.refs(), opt, p.dims, p.scale)
    }

    fn output_tensors(out: &KdaOutputs<T>) -> Vec<Option<&ArrayD<T>>> {
        vec![Some(&out.o), out.final_state.as_ref()]
    }

    fn grad_tensors(gr: &KdaGrads<T>) -> Vec<Option<&ArrayD<T>>> {
        vec![
            Some(&gr.dq),
            Some(&gr.dk),
            Some(&gr.dv),
            Some(&gr.dg),
            Some(&gr.dbeta),
            gr.da_log.as_ref(),
            gr.ddt_bias.as_ref(),
            gr.dh0.as_ref(),
        ]
    }

    fn head_dh0(g: &KdaHeadGrads<T>) -> &Array2<T> {
        &g.dh0
    }

    crate::grads_in_place!(PreparedGrads<T>, KdaHeadGradsMut);

    fn chain_grads(
        x: &KdaInputs<T>,
        opt: &KdaOptions,
        p: &Prepared<'_, T>,
        b: PreparedGrads<T>,
    ) -> KdaGrads<T> {
        b.chain(&x.refs(), opt, p.dims, p.scale)
    }

    fn narrow(x: &KdaInputs<f64>) -> KdaInputs<T> {
        x.cast()
    }
}

/// The decay `g [B, T, HV, K]` and, for an in-kernel gate with
/// `derivatives`, its partial derivatives `(∂g/∂x, ∂g/∂A_log)` (x = raw g +
/// dt_bias), element by element ([`gates::gate_eval_run`] over each row of
/// `K`, rows in parallel).
#[allow(clippy::type_complexity)]
fn gate_terms<'a, T: Scalar>(
    x: &KdaRefs<'a, T>,
    opt: &KdaOptions,
    d: &KdaDims,
    derivatives: bool,
) -> (CowArray<'a, T, Ix4>, Option<(Array4<T>, Array4<T>)>) {
    use rayon::prelude::*;
    let shape = (d.b, d.t, d.hv, d.k);
    let raw = if d.scalar_gate {
        let g3 = x.g.view().into_dimensionality::<Ix3>().expect("validated");
        let g4 = g3.insert_axis(Axis(3));
        CowArray::from(g4.broadcast(shape).expect("broadcast over K").to_owned())
    } else {
        CowArray::from(tensor::view4(x.g))
    };
    if opt.gate == Gate::None {
        return (raw, None);
    }
    let flat = |a: Option<&ArrayD<T>>| a.map(|a| a.iter().copied().collect::<Vec<T>>());
    let (a_log, dt_bias) = (flat(x.a_log), flat(x.dt_bias));
    let raw = views::standard(raw.view());
    let mut g = Array4::zeros(shape);
    let (mut dx, mut da) = match derivatives {
        true => (Array4::zeros(shape), Array4::zeros(shape)),
        false => (Array4::zeros((0, 0, 0, 0)), Array4::zeros((0, 0, 0, 0))),
    };
    let k = d.k;
    // Rows of K in blocks, a block per task; row r belongs to head r mod HV.
    const ROWS: usize = 64;
    let block = ROWS * k;
    let raw = raw.as_slice().expect("standard layout");
    let g_blocks = g
        .as_slice_mut()
        .expect("standard layout")
        .par_chunks_mut(block);
    let mut d_blocks: Vec<_> = if derivatives {
        let dx = dx
            .as_slice_mut()
            .expect("standard layout")
            .chunks_mut(block);
        let da = da
            .as_slice_mut()
            .expect("standard layout")
            .chunks_mut(block);
        dx.zip(da).map(Some).collect()
    } else {
        (0..raw.len().div_ceil(block.max(1)))
            .map(|_| None)
            .collect()
    };
    g_blocks
        .zip(raw.par_chunks(block))
        .zip(d_blocks.par_iter_mut())
        .enumerate()
        .for_each(|(b, ((g, raw), dv))| {
            crate::fast::simd::dispatch(
                #[inline(always)]
                || {
                    let mut xs = vec![T::zero(); k];
                    for (r, (g, raw)) in g.chunks_mut(k).zip(raw.chunks(k)).enumerate() {
                        let h = (b * ROWS + r) % d.hv;
                        for (j, (x, &v)) in xs.iter_mut().zip(raw).enumerate() {
                            *x = v + dt_bias.as_ref().map_or(T::zero(), |bias| bias[h * k + j]);
                        }
                        let a = a_log.as_ref().map(|a| a[h]);
                        let row = r * k..(r + 1) * k;
                        let derivs = dv
                            .as_mut()
                            .map(|(dx, da)| (&mut dx[row.clone()], &mut da[row.clone()]));
                        gates::gate_eval_run(opt.gate, &xs, a, g, derivs);
                    }
                },
            )
        });
    (CowArray::from(g), derivatives.then_some((dx, da)))
}

impl KdaDims {
    /// Validates the upstream gradients `do [B,T,HV,V]` and `dht [N,HV,K,V]`.
    pub fn validate_upstream<T: Scalar>(
        &self,
        d_o: &ArrayD<T>,
        dht: Option<&ArrayD<T>>,
    ) -> Result<()> {
        let d = self;
        expect_finite("do", "[B,T,HV,V]", &[d.b, d.t, d.hv, d.v], d_o)?;
        if let Some(dht) = dht {
            expect_finite("dht", "[N,HV,K,V]", &[d.n, d.hv, d.k, d.v], dht)?;
        }
        Ok(())
    }
}

impl<T: Scalar> PreparedGrads<T> {
    /// Zero gradients for a problem of sizes `d`.
    pub fn zeros(d: &KdaDims) -> Self {
        let tokens = |w| views::zeros(Ix4(d.b, d.t, d.hv, w));
        PreparedGrads {
            dq: tokens(d.k),
            dk: tokens(d.k),
            dv: tokens(d.v),
            dg: tokens(d.k),
            dbeta: Array3::zeros((d.b, d.t, d.hv)),
            dh0: Array4::zeros((d.n, d.hv, d.k, d.v)),
        }
    }

    /// Each (segment, value head) pair's rows of these tensors, in pair
    /// order, as one piece's gradients.
    pub fn sinks(&mut self, segments: &[Segment]) -> Vec<KdaHeadGradsMut<'_, T>> {
        let (dq, dk, dv, dg) = (
            views::pair_blocks_mut(self.dq.view_mut(), segments),
            views::pair_blocks_mut(self.dk.view_mut(), segments),
            views::pair_blocks_mut(self.dv.view_mut(), segments),
            views::pair_blocks_mut(self.dg.view_mut(), segments),
        );
        let dbeta = views::pair_blocks_mut(self.dbeta.view_mut(), segments);
        let dh0 = views::pair_states_mut(self.dh0.view_mut(), segments);
        dq.into_iter()
            .zip(dk)
            .zip(dv)
            .zip(dg)
            .zip(dbeta)
            .zip(dh0)
            .map(|(((((dq, dk), dv), dg), dbeta), dh0)| KdaHeadGradsMut {
                dq,
                dk,
                dv,
                dg,
                dbeta,
                dh0,
            })
            .collect()
    }

    /// The per-token gradients of `(segment, value head, gradients)` pieces,
    /// one tensor per parallel task, and `dh0 [N, HV, K, V]`. The pieces are
    /// freed on return.
    pub fn from_pieces(
        d: &KdaDims,
        pieces: Vec<(Segment, usize, KdaHeadGrads<T>)>,
        dh0: Array4<T>,
    ) -> Self {
        let mut dbeta = Array3::zeros((d.b, d.t, d.hv));
        let mut blocks: [Vec<_>; 4] = Default::default();
        for (seg, h, g) in pieces {
            dbeta
                .slice_mut(s![seg.batch, seg.start..seg.end, h])
                .assign(&g.dbeta);
            for (list, a) in blocks.iter_mut().zip([g.dq, g.dk, g.dv, g.dg]) {
                list.push((seg, h, a));
            }
        }
        let tokens = |blocks, width| tensor::assemble((d.b, d.t, d.hv, width), blocks);
        let [dq, dk, dv, dg] = blocks;
        let ((dq, dk), (dv, dg)) = rayon::join(
            || rayon::join(|| tokens(dq, d.k), || tokens(dk, d.k)),
            || rayon::join(|| tokens(dv, d.v), || tokens(dg, d.k)),
        );
        PreparedGrads {
            dq,
            dk,
            dv,
            dg,
            dbeta,
            dh0,
        }
    }

    /// Chain rule through GVA, `scale`, l2norm, gate and beta sigmoid, for
    /// inputs `x` of sizes `d`.
    pub fn chain(
        self,
        x: &KdaRefs<'_, T>,
        opt: &KdaOptions,
        d: KdaDims,
        scale: f64,
    ) -> KdaGrads<T> {
        // Sum each GVA group of value heads onto its q/k head, in head order,
        // then scale: `(0 + a_0 + a_1 + …) · factor`. With one value head per
        // q/k head that is a map in place (same bits, no new tensor).
        let group_sum = |mut a: Array4<T>, factor: T| {
            if d.groups() == 1 {
                a.mapv_inplace(|v| (T::zero() + v) * factor);
                return a;
            }
            let mut out = Array4::zeros((d.b, d.t, d.h, d.k));
            for h in 0..d.h {
                let mut dst = out.slice_mut(s![.., .., h, ..]);
                for j in h * d.groups()..(h + 1) * d.groups() {
                    dst += &a.slice(s![.., .., j, ..]);
                }
                dst.mapv_inplace(|v| v * factor);
            }
            out
        };
        let mut dq = group_sum(self.dq, T::c(scale));
        let mut dk = group_sum(self.dk, T::one());
        if opt.use_qk_l2norm_in_kernel {
            dq = gates::l2norm_bwd(&tensor::view4(x.q), &dq);
            dk = gates::l2norm_bwd(&tensor::view4(x.k), &dk);
        }
        let (dg, da_log, ddt_bias) = gate_backward(x, opt, &d, self.dg);
        let dbeta = if opt.use_beta_sigmoid_in_kernel {
            let raw = x
                .beta
                .view()
                .into_dimensionality::<Ix3>()
                .expect("validated");
            ndarray::Zip::from(&self.dbeta)
                .and(&raw)
                .map_collect(|&db, &b| db * gates::beta_sigmoid(b, opt.allow_neg_eigval).1)
        } else {
            self.dbeta
        };
        KdaGrads {
            dq: dq.into_dyn(),
            dk: dk.into_dyn(),
            dv: self.dv.into_dyn(),
            dg,
            dbeta: dbeta.into_dyn(),
            da_log,
            ddt_bias,
            dh0: x.initial_state.map(|_| self.dh0.into_dyn()),
        }
    }
}

/// Returns `(dg shaped like x.g, dA_log, ddt_bias)` from the decay gradient.
fn gate_backward<T: Scalar>(
    x: &KdaRefs<'_, T>,
    opt: &KdaOptions,
    d: &KdaDims,
    dgate: Array4<T>,
) -> (ArrayD<T>, Option<ArrayD<T>>, Option<ArrayD<T>>) {
    if d.scalar_gate {
        return (dgate.sum_axis(Axis(3)).into_dyn(), None, None);
    }
    let Some((dg_dx, dg_da)) = gate_terms(x, opt, d, true).1 else {
        return (dgate.into_dyn(), None, None);
    };
    let dg = &dgate * &dg_dx;
    // Serial sums in index order keep the result thread-count independent.
    let da = Array1::from_shape_fn(d.hv, |h| {
        (&dgate.slice(s![.., .., h, ..]) * &dg_da.slice(s![.., .., h, ..])).sum()
    });
    let mut dbias = Array1::<T>::zeros(d.hv * d.k);
    for h in 0..d.hv {
        let col = dg
            .slice(s![.., .., h, ..])
            .sum_axis(Axis(0))
            .sum_axis(Axis(0));
        dbias.slice_mut(s![h * d.k..(h + 1) * d.k]).assign(&col);
    }
    let shape_of = |a: Option<&ArrayD<T>>| a.map(|a| IxDyn(a.shape()));
    (
        dg.into_dyn(),
        shape_of(x.a_log).map(|s| da.into_shape_with_order(s).expect("A_log is [HV]")),
        shape_of(x.dt_bias).map(|s| dbias.into_shape_with_order(s).expect("dt_bias is [HV*K]")),
    )
}
