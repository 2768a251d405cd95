//! GDN, FLA's gated delta rule (`chunk_gated_delta_rule`,
//! `naive_recurrent_gated_delta_rule`): per value head, with one scalar
//! log-space gate `g_t` per token,
//! `S_t = (I − β_t k_t k_tᵀ) exp(g_t) S_{t−1} + β_t k_t v_tᵀ`, `o_t = S_tᵀ (scale·q_t)`.
//!
//! GDN is KDA with the gate broadcast over K (SPEC §3): `Diag(exp g_t 1_K) =
//! exp(g_t) I`, so every KDA engine (naive, chunked, CP, intra-card, with its
//! precision policy) computes GDN exactly, and since `g_t[d] = g_t` for every
//! `d`, `∂L/∂g_t = Σ_d ∂L/∂g_t[d]` (KDA's scalar-gate path sums its per-key
//! gate gradient over K). This module only adds what GDN has of its own:
//! the per-head in-kernel gate `−exp(A_log[h])·softplus(g + dt_bias[h])`
//! (`dt_bias [HV]`, not KDA's `[HV·K]`) and the `state_v_first` state layout
//! `[N, HV, V, K]`.

use ndarray::{Array1, Array3, ArrayD, Axis, Ix3, Zip};

use crate::cp::plan::PlanSpec;
use crate::cp::{kda as cp_kda, CpOptions, RankDiag};
use crate::error::{Error, Result};
use crate::gates::{self, Gate};
use crate::kda::{self, KdaEngine, KdaGrads, KdaInputs, KdaOptions, KdaOutputs};
use crate::scalar::Scalar;
use crate::tensor::{self, check_finite, expect_rank, expect_shape};

/// GDN inputs in FLA's layout.
#[derive(Clone, Debug)]
pub struct GdnInputs<T> {
    /// `[B, T, H, K]`
    pub q: ArrayD<T>,
    /// `[B, T, H, K]`
    pub k: ArrayD<T>,
    /// `[B, T, HV, V]`, HV a multiple of H (GVA)
    pub v: ArrayD<T>,
    /// `[B, T, HV]` log-space decay, or the raw gate input with
    /// `use_gate_in_kernel`.
    pub g: ArrayD<T>,
    /// `[B, T, HV]` (a logit with `use_beta_sigmoid_in_kernel`)
    pub beta: ArrayD<T>,
    /// `[HV]`, the in-kernel gate's decay rate
    pub a_log: Option<ArrayD<T>>,
    /// `[HV]`, the in-kernel gate's bias
    pub dt_bias: Option<ArrayD<T>>,
    /// `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`)
    pub initial_state: Option<ArrayD<T>>,
    /// `[N + 1]`, varlen mode (B = 1)
    pub cu_seqlens: Option<Vec<i64>>,
}

impl<T: Scalar> GdnInputs<T> {
    /// The same inputs in another scalar.
    pub fn cast<U: Scalar>(&self) -> GdnInputs<U> {
        GdnInputs {
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
pub fn swap_state<T: Scalar>(s: &ArrayD<T>) -> ArrayD<T> {
    let mut t = s.view();
    t.swap_axes(2, 3);
    t.as_standard_layout().into_owned()
}

/// Swaps a state-shaped tensor between GDN's layout and KDA's `[N, HV, K, V]`.
fn kv_layout<T: Scalar>(opt: &GdnOptions, s: &ArrayD<T>) -> ArrayD<T> {
    if opt.state_v_first {
        swap_state(s)
    } else {
        s.clone()
    }
}

/// Checks what KDA's validation cannot see: `g` is one scalar per head, the
/// gate parameters are per head, and the `state_v_first` state shape.
fn validate<T: Scalar>(x: &GdnInputs<T>, opt: &GdnOptions) -> Result<()> {
    let qs = expect_rank("q", "B,T,H,K", &x.q)?;
    let (b, t, kd) = (qs[0], qs[1], qs[3]);
    let vs = expect_rank("v", "B,T,HV,V", &x.v)?;
    let (hv, vd) = (vs[2], vs[3]);
    expect_shape(
        "g",
        "[B,T,HV] (one log-space gate per head)",
        &[b, t, hv],
        x.g.shape(),
    )?;
    if opt.use_gate_in_kernel {
        let a = x.a_log.as_ref().ok_or_else(|| {
            Error::missing(
                "A_log",
                "use_gate_in_kernel computes −exp(A_log)·softplus(g + dt_bias): A_log [HV] is required",
            )
        })?;
        expect_shape("A_log", "[HV]", &[hv], a.shape())?;
        check_finite("A_log", a)?;
        if let Some(d) = &x.dt_bias {
            expect_shape("dt_bias", "[HV]", &[hv], d.shape())?;
            check_finite("dt_bias", d)?;
        }
    } else if x.a_log.is_some() || x.dt_bias.is_some() {
        return Err(Error::option(
            "use_gate_in_kernel",
            "A_log/dt_bias were given but use_gate_in_kernel is false (g is already the decay)",
        ));
    }
    if let (Some(h0), true) = (&x.initial_state, opt.state_v_first) {
        let n = match &x.cu_seqlens {
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

/// The per-head decay `−exp(A_log[h])·softplus(g + dt_bias[h])` `[B, T, HV]`
/// and its partial derivatives `(∂/∂g, ∂/∂A_log)`, element by element.
fn in_kernel_gate<T: Scalar>(x: &GdnInputs<T>) -> (Array3<T>, Array3<T>, Array3<T>) {
    let g = x.g.view().into_dimensionality::<Ix3>().expect("validated");
    let a_log: Vec<T> = x.a_log.iter().flatten().copied().collect();
    let bias: Option<Vec<T>> = x.dt_bias.as_ref().map(|d| d.iter().copied().collect());
    let mut out = (
        Array3::zeros(g.raw_dim()),
        Array3::zeros(g.raw_dim()),
        Array3::zeros(g.raw_dim()),
    );
    Zip::indexed(&mut out.0)
        .and(&mut out.1)
        .and(&mut out.2)
        .and(&g)
        .for_each(|(_, _, h), gd, dx, da, &raw| {
            let shifted = raw + bias.as_ref().map_or(T::zero(), |b| b[h]);
            (*gd, *dx, *da) = gates::gate_eval(Gate::Kda, shifted, Some(a_log[h]));
        });
    out
}

/// The KDA problem that computes this GDN problem: the decay evaluated (in
/// kernel gate), the scalar gate left `[B, T, HV]` for KDA to broadcast, the
/// state in `[N, HV, K, V]`.
pub fn to_kda<T: Scalar>(x: &GdnInputs<T>, opt: &GdnOptions) -> Result<(KdaInputs<T>, KdaOptions)> {
    validate(x, opt)?;
    let g = if opt.use_gate_in_kernel {
        check_finite("g", &x.g)?;
        in_kernel_gate(x).0.into_dyn()
    } else {
        x.g.clone()
    };
    let kx = KdaInputs {
        q: x.q.clone(),
        k: x.k.clone(),
        v: x.v.clone(),
        g,
        beta: x.beta.clone(),
        a_log: None,
        dt_bias: None,
        initial_state: x.initial_state.as_ref().map(|s| kv_layout(opt, s)),
        cu_seqlens: x.cu_seqlens.clone(),
    };
    let kopt = KdaOptions {
        scale: opt.scale,
        output_final_state: opt.output_final_state,
        use_qk_l2norm_in_kernel: opt.use_qk_l2norm_in_kernel,
        gate: Gate::None,
        use_beta_sigmoid_in_kernel: opt.use_beta_sigmoid_in_kernel,
        allow_neg_eigval: opt.allow_neg_eigval,
    };
    Ok((kx, kopt))
}

fn outputs_from_kda<T: Scalar>(o: KdaOutputs<T>, opt: &GdnOptions) -> GdnOutputs<T> {
    GdnOutputs {
        o: o.o,
        final_state: o.final_state.map(|s| kv_layout(opt, &s)),
    }
}

/// Chains KDA's gradients (decay `dg [B, T, HV]`, states in `[K, V]`) back to
/// GDN's inputs: through the in-kernel gate and the state layout.
fn grads_from_kda<T: Scalar>(g: KdaGrads<T>, x: &GdnInputs<T>, opt: &GdnOptions) -> GdnGrads<T> {
    let (dg, da_log, ddt_bias) = if opt.use_gate_in_kernel {
        let ddecay = g.dg.into_dimensionality::<Ix3>().expect("[B,T,HV]");
        let (_, dgate_dx, dgate_da) = in_kernel_gate(x);
        let dg = &ddecay * &dgate_dx;
        // Serial sums in index order: the result does not depend on threads.
        let per_head = |a: &Array3<T>| a.sum_axis(Axis(0)).sum_axis(Axis(0));
        let da: Array1<T> = per_head(&(&ddecay * &dgate_da));
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
        dh0: g.dh0.map(|s| kv_layout(opt, &s)),
    }
}

/// Forward with any KDA engine (naive or chunked) over every (sequence, value head).
pub fn forward<T: Scalar, E: KdaEngine<T>>(
    engine: &E,
    x: &GdnInputs<T>,
    opt: &GdnOptions,
) -> Result<GdnOutputs<T>> {
    let (kx, kopt) = to_kda(x, opt)?;
    Ok(outputs_from_kda(kda::forward(engine, &kx, &kopt)?, opt))
}

/// Backward of `Σ o·do + Σ final_state·dht`: `do [B, T, HV, V]`, `dht`
/// shaped like `final_state` (zero when `None`).
pub fn backward<T: Scalar, E: KdaEngine<T>>(
    engine: &E,
    x: &GdnInputs<T>,
    opt: &GdnOptions,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
) -> Result<GdnGrads<T>> {
    let (kx, kopt) = to_kda(x, opt)?;
    let dht = upstream_state(opt, dht)?;
    let g = kda::backward(engine, &kx, &kopt, d_o, dht.as_ref())?;
    Ok(grads_from_kda(g, x, opt))
}

/// `dht` in `[N, HV, K, V]`; a `state_v_first` `dht` must be rank 4 to swap.
fn upstream_state<T: Scalar>(
    opt: &GdnOptions,
    dht: Option<&ArrayD<T>>,
) -> Result<Option<ArrayD<T>>> {
    dht.map(|d| {
        if opt.state_v_first && d.ndim() != 4 {
            return Err(Error::shape("dht", "[N,HV,V,K] (state_v_first)", d.shape()));
        }
        Ok(kv_layout(opt, d))
    })
    .transpose()
}

/// CP forward (SPEC §6) through KDA's CP driver: the same outputs as
/// [`forward`], computed rank by rank; also the per-rank diagnostics.
pub fn forward_cp<T: Scalar, E: KdaEngine<T>>(
    engine: &E,
    x: &GdnInputs<T>,
    opt: &GdnOptions,
    plan: &PlanSpec,
    cp: &CpOptions,
) -> Result<(GdnOutputs<T>, Vec<RankDiag<T>>)> {
    let (kx, kopt) = to_kda(x, opt)?;
    let (o, diags) = cp_kda::forward(engine, &kx, &kopt, plan, cp)?;
    Ok((outputs_from_kda(o, opt), diags))
}

/// CP backward: the same gradients as [`backward`], computed rank by rank.
pub fn backward_cp<T: Scalar, E: KdaEngine<T>>(
    engine: &E,
    x: &GdnInputs<T>,
    opt: &GdnOptions,
    d_o: &ArrayD<T>,
    dht: Option<&ArrayD<T>>,
    plan: &PlanSpec,
    cp: &CpOptions,
) -> Result<(GdnGrads<T>, Vec<RankDiag<T>>)> {
    let (kx, kopt) = to_kda(x, opt)?;
    let dht = upstream_state(opt, dht)?;
    let (g, diags) = cp_kda::backward(engine, &kx, &kopt, d_o, dht.as_ref(), plan, cp)?;
    Ok((grads_from_kda(g, x, opt), diags))
}
