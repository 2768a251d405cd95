//! GDN, FLA's gated delta rule (`chunk_gated_delta_rule`,
//! `naive_recurrent_gated_delta_rule`): per value head, with one scalar
//! log-space gate `g_t` per token,
//! `S_t = (I − β_t k_t k_tᵀ) exp(g_t) S_{t−1} + β_t k_t v_tᵀ`, `o_t = S_tᵀ (scale·q_t)`.
//!
//! GDN is KDA with the gate broadcast over K (SPEC §3): `Diag(exp g_t 1_K) =
//! exp(g_t) I`, so every KDA engine (naive, chunked, with its precision
//! policy) computes a GDN piece exactly: [`Gdn`]'s per-piece tensors are
//! KDA's (`KdaHead`, the gate repeated over K) and [`OnKda`] runs a KDA
//! engine as a GDN engine. Since `g_t[d] = g_t` for every `d`,
//! `∂L/∂g_t = Σ_d ∂L/∂g_t[d]`: KDA's chain rule with a scalar gate sums its
//! per-key gate gradient over K. This module adds what GDN has of its own:
//! the per-head in-kernel gate `−exp(A_log[h])·softplus(g + dt_bias[h])`
//! (`dt_bias [HV]`, not KDA's `[HV·K]`) and the `state_v_first` state layout
//! `[N, HV, V, K]`. The drivers, CP and intra-card come from [`crate::op`].

// The registry entry, listed in `registry::OPS`: tools reach it only there.
pub(crate) mod entry;
// The engine pieces: public types without a public path (see the module).
mod pieces;
pub(crate) mod spec;

use std::borrow::Cow;

use ndarray::{
    s, Array1, Array2, Array3, Array4, ArrayD, ArrayView2, ArrayView4, Axis, CowArray, Ix3, Ix4,
    Zip,
};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::gates::Gate;
use crate::kda::{
    self, Kda, KdaDims, KdaGrads, KdaHead, KdaHeadGrads, KdaHeadGradsMut, KdaOptions, PreparedGrads,
};
use crate::op::{self, Engine, HeadSink, OpSpec, Operator, Shape};
use crate::scalar::Scalar;
use crate::tensor::{self, check_finite, expect_finite, expect_rank, expect_shape};
use crate::varlen::{self, Segment};

pub(crate) use pieces::Prepared;

/// GDN inputs in FLA's layout: KDA's fields (so the same `refs` and
/// `cast`), with GDN's shapes: `q`, `k [B, T, H, K]`, `v [B, T, HV, V]`
/// (HV a multiple of H), one gate per head `g [B, T, HV]` (log-space decay,
/// or the raw gate input with `use_gate_in_kernel`), `beta [B, T, HV]`,
/// `A_log` and `dt_bias` `[HV]` (the in-kernel gate's decay rate and bias),
/// `initial_state [N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`) and
/// `cu_seqlens [N + 1]` in varlen mode (B = 1).
pub type GdnInputs<T> = kda::KdaInputs<T>;

/// GDN inputs borrowed where they live (a case file's tensors): KDA's
/// borrowed form, with GDN's shapes (as in [`GdnInputs`]).
pub type GdnRefs<'a, T> = kda::KdaRefs<'a, T>;

/// FLA `chunk_gated_delta_rule` options (names as in FLA 0.6.0).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct GdnOptions {
    /// Defaults to `K^-0.5`.
    pub scale: Option<f64>,
    pub output_final_state: bool,
    pub use_qk_l2norm_in_kernel: bool,
    /// `g` is raw: the decay is `−exp(A_log[h])·softplus(g + dt_bias[h])`.
    pub use_gate_in_kernel: bool,
    /// `β = sigmoid(beta)` (FLA's default is `False`: beta is used as given).
    pub use_beta_sigmoid_in_kernel: bool,
    /// `β = 2·sigmoid(beta)`; needs `use_beta_sigmoid_in_kernel`.
    pub allow_neg_eigval: bool,
    /// States (`initial_state`, `final_state`, `dh0`, `dht`) are `[N, HV, V, K]`.
    pub state_v_first: bool,
}

/// `o [B, T, HV, V]`, `final_state` (state layout) when asked for.
#[derive(Clone, Debug)]
pub struct GdnOutputs<T> {
    pub o: ArrayD<T>,
    pub final_state: Option<ArrayD<T>>,
}

/// Gradients, each shaped like its input; `None` where the input was absent.
#[derive(Clone, Debug)]
pub struct GdnGrads<T> {
    pub dq: ArrayD<T>,
    pub dk: ArrayD<T>,
    pub dv: ArrayD<T>,
    /// `[B, T, HV]`, with respect to `g` as passed (raw with the in-kernel gate).
    pub dg: ArrayD<T>,
    pub dbeta: ArrayD<T>,
    pub da_log: Option<ArrayD<T>>,
    pub ddt_bias: Option<ArrayD<T>>,
    pub dh0: Option<ArrayD<T>>,
}

/// `[N, HV, a, b]` → `[N, HV, b, a]` (the `state_v_first` layout swap).
pub(crate) fn swap_state<T: Scalar>(s: &ArrayD<T>) -> ArrayD<T> {
    let mut t = s.view();
    t.swap_axes(2, 3);
    t.as_standard_layout().into_owned()
}

impl GdnOptions {
    /// A state-shaped tensor `s` in KDA's `[N, HV, K, V]` from these
    /// options' layout, or back (the swap is its own inverse); borrowed when
    /// there is no swap.
    pub fn kv_layout<'a, T: Scalar>(&self, s: &'a ArrayD<T>) -> Cow<'a, ArrayD<T>> {
        if self.state_v_first {
            Cow::Owned(swap_state(s))
        } else {
            Cow::Borrowed(s)
        }
    }

    /// [`GdnOptions::kv_layout`] of an owned state (moved when there is no swap).
    pub fn kv_layout_owned<T: Scalar>(&self, s: ArrayD<T>) -> ArrayD<T> {
        if self.state_v_first {
            swap_state(&s)
        } else {
            s
        }
    }

    /// The KDA options that compute a GDN problem once its decay is evaluated.
    pub fn kda(&self) -> KdaOptions {
        KdaOptions {
            scale: self.scale,
            output_final_state: self.output_final_state,
            use_qk_l2norm_in_kernel: self.use_qk_l2norm_in_kernel,
            gate: Gate::None,
            use_beta_sigmoid_in_kernel: self.use_beta_sigmoid_in_kernel,
            allow_neg_eigval: self.allow_neg_eigval,
        }
    }

    /// Validates borrowed inputs `x` against these options as
    /// [`Operator::prepare`] does: GDN's own checks, then KDA's on the
    /// decay; returns KDA's sizes. The copies it makes are `[B, T, HV]` (the
    /// in-kernel decay) and state-sized (a `state_v_first` swap), never a
    /// `[B, T, H, K]` tensor.
    pub fn validate_refs<T: Scalar>(&self, x: &GdnRefs<'_, T>) -> Result<KdaDims> {
        Ok(checked(x, self)?.dims)
    }

    /// [`GdnOptions::validate_refs`], also returning the initial state in
    /// KDA's `[N, HV, K, V]` layout (borrowed unless `state_v_first` swapped
    /// it), for callers that run GDN as KDA: the swap made to validate it is
    /// the one they use.
    #[allow(clippy::type_complexity)]
    pub fn validate_refs_kv<'a, T: Scalar>(
        &self,
        x: &GdnRefs<'a, T>,
    ) -> Result<(KdaDims, Option<Cow<'a, ArrayD<T>>>)> {
        let c = checked(x, self)?;
        Ok((c.dims, c.h0))
    }

    /// Validates `do [B, T, HV, V]` and `dht` (`[N, HV, V, K]` with
    /// `state_v_first`, else `[N, HV, K, V]`) against validated sizes `d`.
    pub fn validate_upstream<T: Scalar>(
        &self,
        d: &KdaDims,
        d_o: &ArrayD<T>,
        dht: Option<&ArrayD<T>>,
    ) -> Result<()> {
        validate_upstream(d, self.state_v_first, d_o, dht)
    }
}

/// What [`GdnOptions::validate_refs`] checks and derives on the way.
struct Checked<'a, T: Clone> {
    dims: KdaDims,
    /// The log-space decay `[B, T, HV]` (evaluated with the in-kernel gate,
    /// else a view of `g`).
    decay: CowArray<'a, T, Ix3>,
    /// The initial state in `[N, HV, K, V]`, borrowed unless swapped.
    h0: Option<Cow<'a, ArrayD<T>>>,
}

/// [`GdnOptions::validate_refs`], keeping the decay and the initial state in KDA's layout.
fn checked<'a, T: Scalar>(x: &GdnRefs<'a, T>, opt: &GdnOptions) -> Result<Checked<'a, T>> {
    validate_own(x, opt)?;
    let decay = if opt.use_gate_in_kernel {
        check_finite("g", x.g)?;
        Some(in_kernel_decay(x).into_dyn())
    } else {
        None
    };
    let h0 = x.initial_state.map(|s| opt.kv_layout(s));
    let kx = GdnRefs {
        g: decay.as_ref().unwrap_or(x.g),
        a_log: None,
        dt_bias: None,
        initial_state: h0.as_deref(),
        ..*x
    };
    let dims = kx.validate(&opt.kda())?;
    let decay = match decay {
        Some(g) => CowArray::from(g),
        None => CowArray::from(x.g.view()),
    };
    Ok(Checked {
        dims,
        decay: decay.into_dimensionality().expect("validated [B,T,HV]"),
        h0,
    })
}

/// [`GdnOptions::validate_upstream`] with the layout flag alone (what a
/// [`Prepared`] keeps of the options).
fn validate_upstream<T: Scalar>(
    d: &KdaDims,
    state_v_first: bool,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<()> {
    d.validate_upstream(d_o, None)?;
    if let Some(dht) = dht {
        let (dims, want) = if state_v_first {
            ("[N,HV,V,K] (state_v_first)", [d.n, d.hv, d.v, d.k])
        } else {
            ("[N,HV,K,V]", [d.n, d.hv, d.k, d.v])
        };
        expect_finite("dht", dims, &want, dht)?;
    }
    Ok(())
}

/// What KDA's validation cannot see: `g` is one scalar per head, the gate
/// parameters are per head, and the `state_v_first` state shape.
fn validate_own<T: Scalar>(x: &GdnRefs<'_, T>, opt: &GdnOptions) -> Result<()> {
    let qs = expect_rank("q", "B,T,H,K", x.q)?;
    let (b, t, kd) = (qs[0], qs[1], qs[3]);
    let vs = expect_rank("v", "B,T,HV,V", x.v)?;
    let (hv, vd) = (vs[2], vs[3]);
    expect_shape(
        "g",
        "[B,T,HV] (one log-space gate per head)",
        &[b, t, hv],
        x.g.shape(),
    )?;
    if opt.use_gate_in_kernel {
        let a = x.a_log.ok_or_else(|| {
            Error::missing(
                "A_log",
                "use_gate_in_kernel computes −exp(A_log)·softplus(g + dt_bias): A_log [HV] is required",
            )
        })?;
        expect_finite("A_log", "[HV]", &[hv], a)?;
        if let Some(d) = x.dt_bias {
            expect_finite("dt_bias", "[HV]", &[hv], d)?;
        }
    } else if x.a_log.is_some() || x.dt_bias.is_some() {
        return Err(Error::option(
            "use_gate_in_kernel",
            "A_log/dt_bias were given but use_gate_in_kernel is false (g is already the decay)",
        ));
    }
    if let (Some(h0), true) = (x.initial_state, opt.state_v_first) {
        let n = match x.cu_seqlens {
            Some(cu) => cu.len().saturating_sub(1),
            None => b,
        };
        expect_shape(
            "initial_state",
            "[N,HV,V,K] (state_v_first)",
            &[n, hv, vd, kd],
            h0.shape(),
        )?;
    }
    Ok(())
}

/// `f(g + dt_bias[h], A_log[h])` for every element of `g [B, T, HV]`, in
/// parallel (element by element, so the same bits on any number of
/// threads).
fn per_gate_element<T: Scalar, U: Send>(
    x: &GdnRefs<'_, T>,
    f: impl Fn(T, T) -> U + Sync,
) -> Array3<U> {
    let g = x.g.view().into_dimensionality::<Ix3>().expect("validated");
    let (b, t, hv) = g.dim();
    let a_log: Vec<T> = x.a_log.into_iter().flatten().copied().collect();
    let bias: Option<Vec<T>> = x.dt_bias.map(|d| d.iter().copied().collect());
    let shifted = |raw: T, h: usize| raw + bias.as_ref().map_or(T::zero(), |b| b[h]);
    let out: Vec<U> = (0..b * t * hv)
        .into_par_iter()
        .with_min_len(1 << 12)
        .map(|i| {
            let (bt, h) = (i / hv, i % hv);
            f(shifted(g[[bt / t, bt % t, h]], h), a_log[h])
        })
        .collect();
    Array3::from_shape_vec((b, t, hv), out).expect("[B, T, HV]")
}

/// The per-head decay `−exp(A_log[h])·softplus(g + dt_bias[h])` `[B, T, HV]`.
fn in_kernel_decay<T: Scalar>(x: &GdnRefs<'_, T>) -> Array3<T> {
    per_gate_element(x, |shifted, a| Gate::Kda.eval(shifted, Some(a)).0)
}

/// Chains KDA's gradients (decay `dg [B, T, HV]`, states in `[K, V]`) back to
/// GDN's inputs: through the in-kernel gate and the state layout.
fn grads_from_kda<T: Scalar>(g: KdaGrads<T>, x: &GdnInputs<T>, opt: &GdnOptions) -> GdnGrads<T> {
    let (dg, da_log, ddt_bias) = if opt.use_gate_in_kernel {
        let ddecay = g.dg.into_dimensionality::<Ix3>().expect("[B,T,HV]");
        // The decay's partial derivatives ∂/∂g and ∂/∂A_log.
        let partials = per_gate_element(&x.refs(), |s, a| {
            let (_, dx, da) = Gate::Kda.eval(s, Some(a));
            (dx, da)
        });
        let chain = |part: fn(&(T, T)) -> T| {
            Zip::from(&ddecay)
                .and(&partials)
                .map_collect(|&dd, p| dd * part(p))
        };
        let dg = chain(|p| p.0);
        // Serial sums in index order: the result does not depend on threads.
        let per_head = |a: &Array3<T>| a.sum_axis(Axis(0)).sum_axis(Axis(0));
        let da: Array1<T> = per_head(&chain(|p| p.1));
        let ddt = x.dt_bias.as_ref().map(|_| per_head(&dg).into_dyn());
        (dg.into_dyn(), Some(da.into_dyn()), ddt)
    } else {
        (g.dg, None, None)
    };
    GdnGrads {
        dq: g.dq,
        dk: g.dk,
        dv: g.dv,
        dg,
        dbeta: g.dbeta,
        da_log,
        ddt_bias,
        dh0: g.dh0.map(|s| opt.kv_layout_owned(s)),
    }
}

impl<'a, T: Scalar> Prepared<'a, T> {
    /// Validates `x` and applies l2norm, the gate and beta sigmoid; `q`,
    /// `k`, `v` and the initial state stay views of the inputs where nothing
    /// changes them.
    pub fn new(x: &'a GdnInputs<T>, opt: &GdnOptions) -> Result<Self> {
        let Checked { dims, decay, h0 } = checked(&x.refs(), opt)?;
        let kopt = opt.kda();
        let kda::Activations { q, k, beta } = kda::Activations::new(&x.refs(), &kopt);
        Ok(Prepared {
            dims,
            scale: kopt.scale_for(dims.k),
            segments: varlen::sequences(dims.b, dims.t, x.cu_seqlens.as_deref())?,
            q,
            k,
            v: tensor::view4(&x.v),
            g: decay,
            beta,
            h0: h0.map(|s| match s {
                Cow::Borrowed(s) => CowArray::from(tensor::view4(s)),
                Cow::Owned(s) => CowArray::from(s.into_dimensionality::<Ix4>().expect("validated")),
            }),
            state_v_first: opt.state_v_first,
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
            heads: d.hv,
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

/// A KDA engine (`kda::naive::Naive`, `kda::chunk::Chunk`) computing GDN pieces.
#[derive(Clone, Debug, Default)]
pub struct OnKda<E>(pub E);

impl<T: Scalar, E: Engine<T, Op = Kda>> Engine<T> for OnKda<E> {
    type Op = Gdn;

    fn forward(&self, x: &KdaHead<T>, h0: ArrayView2<T>) -> (Array2<T>, Array2<T>) {
        self.0.forward(x, h0)
    }

    fn backward(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> KdaHeadGrads<T> {
        self.0.backward(x, h0, d_o, dht)
    }

    fn forward_backward(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
    ) -> ((Array2<T>, Array2<T>), KdaHeadGrads<T>) {
        self.0.forward_backward(x, h0, d_o, dht)
    }

    /// GDN's per-pair results are KDA's: the KDA engine writes them.
    fn forward_backward_into(
        &self,
        x: &KdaHead<T>,
        h0: ArrayView2<T>,
        d_o: ArrayView2<T>,
        dht: ArrayView2<T>,
        out: HeadSink<'_, T, Gdn>,
    ) {
        let HeadSink {
            o,
            final_state,
            grads,
        } = out;
        let out = HeadSink::<T, Kda> {
            o,
            final_state,
            grads,
        };
        self.0.forward_backward_into(x, h0, d_o, dht, out)
    }

    fn transition(&self, x: &KdaHead<T>) -> Array2<T> {
        self.0.transition(x)
    }
}

/// GDN, FLA's `chunk_gated_delta_rule` / `naive_recurrent_gated_delta_rule`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Gdn;

// FLA names GDN's tensors as KDA's (only `g`'s and `dt_bias`'s shapes differ).
impl OpSpec for Gdn {
    const NAME: &'static str = "gdn";
    const INPUTS: &'static [&'static str] = Kda::INPUTS;
    const OUTPUTS: &'static [&'static str] = Kda::OUTPUTS;
    const UPSTREAM: &'static [&'static str] = Kda::UPSTREAM;
    const GRADS: &'static [&'static str] = Kda::GRADS;
    type Options = GdnOptions;

    fn all_outputs(opt: &GdnOptions) -> GdnOptions {
        GdnOptions {
            output_final_state: true,
            ..*opt
        }
    }
}

/// GDN's gradients from the KDA run's (its value heads' [`PreparedGrads`]).
fn chain<T: Scalar>(
    x: &GdnInputs<T>,
    opt: &GdnOptions,
    p: &Prepared<'_, T>,
    g: PreparedGrads<T>,
) -> GdnGrads<T> {
    // A scalar gate's chain reads neither `g` nor the gate parameters
    // (GDN's in-kernel gate is chained by `grads_from_kda`).
    let kx = GdnRefs {
        a_log: None,
        dt_bias: None,
        ..x.refs()
    };
    let g = g.chain(&kx, &opt.kda(), p.dims, p.scale);
    grads_from_kda(g, x, opt)
}

impl<T: Scalar> Operator<T> for Gdn {
    type Inputs = GdnInputs<T>;
    type Outputs = GdnOutputs<T>;
    type Grads = GdnGrads<T>;
    type Head<'h> = KdaHead<'h, T>;
    type HeadGrads = KdaHeadGrads<T>;
    type Prepared<'a>
        = Prepared<'a, T>
    where
        T: 'a;

    fn prepare<'a>(x: &'a GdnInputs<T>, opt: &GdnOptions) -> Result<Prepared<'a, T>> {
        Prepared::new(x, opt)
    }

    /// Head `hv` of `seg` as KDA's per-piece tensors: q/k from q/k head
    /// `hv / G` (GVA), q times `scale`, the scalar gate repeated over K.
    fn head<'p>(p: &'p Prepared<'_, T>, seg: &Segment, hv: usize) -> KdaHead<'p, T> {
        let hq = hv / p.dims.groups();
        let g = p.g.slice(s![seg.batch, seg.start..seg.end, hv]);
        KdaHead {
            q: tensor::head_view(p.q.view(), seg, hq).into(),
            k: tensor::head_view(p.k.view(), seg, hq).into(),
            v: tensor::head_view(p.v.view(), seg, hv).into(),
            g: CowArray::from(Array2::from_shape_fn((seg.len(), p.dims.k), |(t, _)| g[t])),
            beta: CowArray::from(p.beta.slice(s![seg.batch, seg.start..seg.end, hv])),
            scale: T::c(p.scale),
        }
    }

    fn cu_seqlens(x: &GdnInputs<T>) -> Option<&[i64]> {
        x.cu_seqlens.as_deref()
    }

    fn validate_upstream(
        p: &Prepared<'_, T>,
        d_o: &ArrayD<T>,
        dht: Option<&ArrayD<T>>,
    ) -> Result<()> {
        validate_upstream(&p.dims, p.state_v_first, d_o, dht)
    }

    fn dht_view<'d>(opt: &GdnOptions, dht: &'d ArrayD<T>) -> ArrayView4<'d, T> {
        let mut v = tensor::view4(dht);
        if opt.state_v_first {
            v.swap_axes(2, 3);
        }
        v
    }

    fn probe<'h>(x: &Self::Head<'h>) -> (Self::Head<'h>, usize) {
        <Kda as Operator<T>>::probe(x)
    }

    fn outputs(opt: &GdnOptions, o: Array4<T>, final_state: Array4<T>) -> GdnOutputs<T> {
        GdnOutputs {
            o: o.into_dyn(),
            final_state: opt
                .output_final_state
                .then(|| opt.kv_layout_owned(final_state.into_dyn())),
        }
    }

    fn grads(
        x: &GdnInputs<T>,
        opt: &GdnOptions,
        p: &Prepared<'_, T>,
        pieces: Vec<(Segment, usize, KdaHeadGrads<T>)>,
        dh0: Array4<T>,
    ) -> GdnGrads<T> {
        chain(x, opt, p, PreparedGrads::from_pieces(&p.dims, pieces, dh0))
    }

    fn output_tensors(out: &GdnOutputs<T>) -> Vec<Option<&ArrayD<T>>> {
        vec![Some(&out.o), out.final_state.as_ref()]
    }

    fn grad_tensors(gr: &GdnGrads<T>) -> Vec<Option<&ArrayD<T>>> {
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
        x: &GdnInputs<T>,
        opt: &GdnOptions,
        p: &Prepared<'_, T>,
        b: PreparedGrads<T>,
    ) -> GdnGrads<T> {
        chain(x, opt, p, b)
    }

    fn narrow(x: &GdnInputs<f64>) -> GdnInputs<T> {
        x.cast()
    }
}
