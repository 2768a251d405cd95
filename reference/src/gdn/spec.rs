//! GDN's generated problems: [`GdnSpec`], KDA's scalar-gate draws with
//! GDN's per-head `dt_bias` and state layout (published as
//! `deltaref::inputs::GdnSpec`).

use ndarray::ArrayD;

use super::{GdnInputs, GdnOptions};
use crate::gates::Gate;
use crate::inputs::draw::{channel_tensor, gate_maps, Generated, Layout, Regime};
use crate::kda::spec::{kda_in, KdaSpec};
use crate::kda::KdaOptions;

/// What a generated GDN problem contains.
#[derive(Clone, Debug, PartialEq)]
pub struct GdnSpec {
    pub layout: Layout,
    pub h: usize,
    pub hv: usize,
    pub k: usize,
    pub v: usize,
    pub opts: GdnOptions,
    pub initial_state: bool,
    pub seed: u64,
}

impl GdnSpec {
    /// GDN inputs in FLA's test draws ([`Regime::FlaTest`]).
    pub fn generate(&self) -> Generated<GdnInputs<f64>> {
        gdn_in(self, Regime::FlaTest)
    }

    /// GDN inputs drawn in `regime`: KDA's scalar-gate draws (the same named
    /// streams, the in-kernel gate drawn as KDA's `kda` gate), with `dt_bias`
    /// per head (`[HV]`) and the states in the `state_v_first` layout when asked.
    pub fn generate_in(&self, regime: Regime) -> Generated<GdnInputs<f64>> {
        gdn_in(self, regime)
    }
}

/// [`GdnSpec::generate_in`].
pub(crate) fn gdn_in(s: &GdnSpec, regime: Regime) -> Generated<GdnInputs<f64>> {
    let o = &s.opts;
    let gate = if o.use_gate_in_kernel {
        Gate::Kda
    } else {
        Gate::None
    };
    let kspec = KdaSpec {
        layout: s.layout.clone(),
        h: s.h,
        hv: s.hv,
        k: s.k,
        v: s.v,
        opts: KdaOptions {
            gate,
            use_qk_l2norm_in_kernel: o.use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel: o.use_beta_sigmoid_in_kernel,
            allow_neg_eigval: o.allow_neg_eigval,
            ..KdaOptions::default()
        },
        initial_state: s.initial_state,
        scalar_gate: true,
        seed: s.seed,
    };
    let g = kda_in(&kspec, regime);
    let state = |a: ArrayD<f64>| {
        if o.state_v_first {
            crate::gdn::swap_state(&a)
        } else {
            a
        }
    };
    let dt_bias_map = gate_maps(regime, gate).2;
    let x = g.inputs;
    Generated {
        inputs: GdnInputs {
            q: x.q,
            k: x.k,
            v: x.v,
            g: x.g,
            beta: x.beta,
            a_log: x.a_log,
            dt_bias: o.use_gate_in_kernel.then(|| {
                channel_tensor(s.seed, "dt_bias", &[s.hv], 1, |x, h| {
                    dt_bias_map(x, regime.slow(s.seed, h * s.k))
                })
            }),
            initial_state: x.initial_state.map(state),
            cu_seqlens: x.cu_seqlens,
        },
        d_o: g.d_o,
        dht: state(g.dht),
    }
}
