//! KDA's generated problems: [`KdaSpec`] and its draws under FLA's names
//! (published as `deltaref::inputs::KdaSpec`).

use super::{KdaInputs, KdaOptions};
use crate::gates::{self, Gate};
use crate::inputs::draw::{
    channel_tensor, direct_log_decay, gate_maps, tensor, AllDrawn, Draw, Generated, Layout, Regime,
};

/// What a generated KDA problem contains.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaSpec {
    pub layout: Layout,
    pub h: usize,
    pub hv: usize,
    pub k: usize,
    pub v: usize,
    pub opts: KdaOptions,
    pub initial_state: bool,
    /// Per-head scalar gate `g [B,T,HV]` (GDN).
    pub scalar_gate: bool,
    pub seed: u64,
}

impl KdaSpec {
    /// FLA's test draws ([`Regime::FlaTest`]): q, k, v normal; `g =
    /// logsigmoid(N)` (raw normal with an in-kernel gate); `beta = sigmoid(N)`
    /// (raw normal with `use_beta_sigmoid_in_kernel`); `A_log = N/2`, `dt_bias =
    /// N/2`; `initial_state` normal.
    pub fn generate(&self) -> Generated<KdaInputs<f64>> {
        kda_in(self, Regime::FlaTest)
    }

    /// KDA inputs drawn in `regime` (see [`Regime`]); the same named streams as
    /// [`KdaSpec::generate`], mapped differently. Under `sharp` without
    /// `use_qk_l2norm_in_kernel` the keys are scaled by `K^-1/2` (unit norm on
    /// average) so that β ≈ 1 keeps the recurrence stable.
    pub fn generate_in(&self, regime: Regime) -> Generated<KdaInputs<f64>> {
        kda_in(self, regime)
    }
}

/// [`KdaSpec::generate_in`].
pub(crate) fn kda_in(s: &KdaSpec, regime: Regime) -> Generated<KdaInputs<f64>> {
    let mut d = AllDrawn::all(kda_draws(s, regime));
    Generated {
        inputs: KdaInputs {
            q: d.take("q"),
            k: d.take("k"),
            v: d.take("v"),
            g: d.take("g"),
            beta: d.take("beta"),
            a_log: d.maybe("A_log"),
            dt_bias: d.maybe("dt_bias"),
            initial_state: d.maybe("initial_state"),
            cu_seqlens: s.layout.cu_seqlens(),
        },
        d_o: d.take("do"),
        dht: d.take("dht"),
    }
}

/// [`kda_in`]'s tensors one by one, under FLA's names (`q`, `k`, `v`, `g`,
/// `beta`, `A_log` and `dt_bias` with an in-kernel gate, `initial_state`
/// when asked, `do`, `dht`).
pub(crate) fn kda_draws(s: &KdaSpec, regime: Regime) -> Vec<Draw> {
    let (b, t, n, seed, k) = (s.layout.b, s.layout.t, s.layout.n(), s.seed, s.k);
    let (gshape, gdims): (Vec<usize>, usize) = if s.scalar_gate {
        (vec![b, t, s.hv], 1)
    } else {
        (vec![b, t, s.hv, k], 2)
    };
    // A scalar gate's channel is its head: index it like key dim 0.
    let scalar_gate = s.scalar_gate;
    let chan = move |c: usize| if scalar_gate { c * k } else { c };
    let g = match s.opts.gate {
        Gate::None => Draw::new("g", gshape, move |sh| {
            channel_tensor(seed, "g", sh, gdims, |x, c| {
                direct_log_decay(regime, regime.slow(seed, chan(c)), x)
            })
        }),
        gate => Draw::new("g", gshape, move |sh| {
            tensor(seed, "g", sh, gate_maps(regime, gate).0)
        }),
    };
    let beta = if s.opts.use_beta_sigmoid_in_kernel {
        Draw::new("beta", vec![b, t, s.hv], move |sh| {
            tensor(seed, "beta", sh, |x| regime.beta_logit(x))
        })
    } else {
        Draw::new("beta", vec![b, t, s.hv], move |sh| {
            tensor(seed, "beta", sh, |x| gates::sigmoid(regime.beta_logit(x)))
        })
    };
    let (_, a_log_map, dt_bias_map) = gate_maps(regime, s.opts.gate);
    let key_scale = if regime == Regime::Sharp && !s.opts.use_qk_l2norm_in_kernel {
        1.0 / (k as f64).sqrt()
    } else {
        1.0
    };
    let gated = s.opts.gate != Gate::None;
    let mut draws = vec![
        Draw::normal(seed, "q", vec![b, t, s.h, k]),
        Draw::new("k", vec![b, t, s.h, k], move |sh| {
            channel_tensor(seed, "k", sh, 1, |x, d| {
                x * key_scale * regime.key_weight(d, k)
            })
        }),
        Draw::normal(seed, "v", vec![b, t, s.hv, s.v]),
        g,
        beta,
    ];
    if gated {
        draws.push(Draw::new("A_log", vec![s.hv], move |sh| {
            tensor(seed, "A_log", sh, a_log_map)
        }));
        draws.push(Draw::new("dt_bias", vec![s.hv * k], move |sh| {
            channel_tensor(seed, "dt_bias", sh, 1, |x, c| {
                dt_bias_map(x, regime.slow(seed, c))
            })
        }));
    }
    let state = vec![n, s.hv, k, s.v];
    if s.initial_state {
        draws.push(Draw::normal(seed, "initial_state", state.clone()));
    }
    draws.push(Draw::normal(seed, "do", vec![b, t, s.hv, s.v]));
    draws.push(Draw::normal(seed, "dht", state));
    draws
}
