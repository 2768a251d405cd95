//! Deterministic random inputs shaped like FLA's tests (see [`crate::rng`] for
//! the generator): what `selfcheck`, `gen`, fixtures, benchmarks and tests use.

use ndarray::{Array, ArrayD, Axis, IxDyn};

use crate::conv::ConvInputs;
use crate::dplr::DplrInputs;
use crate::gates::{self, Gate};
use crate::gdn::{GdnInputs, GdnOptions};
use crate::kda::{KdaInputs, KdaOptions};
use crate::rng::Stream;
use crate::token_shift::TokenShiftInputs;

/// Shape of a generated problem. With `lengths`, `B` is 1 and `T = Σ lengths`.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub b: usize,
    pub t: usize,
    pub lengths: Option<Vec<usize>>,
}

impl Layout {
    pub fn batch(b: usize, t: usize) -> Self {
        Layout {
            b,
            t,
            lengths: None,
        }
    }

    pub fn varlen(lengths: &[usize]) -> Self {
        Layout {
            b: 1,
            t: lengths.iter().sum(),
            lengths: Some(lengths.to_vec()),
        }
    }

    /// Number of sequences.
    pub fn n(&self) -> usize {
        self.lengths.as_ref().map_or(self.b, Vec::len)
    }

    pub fn cu_seqlens(&self) -> Option<Vec<i64>> {
        self.lengths.as_ref().map(|l| {
            std::iter::once(0)
                .chain(l.iter().scan(0i64, |acc, &x| {
                    *acc += x as i64;
                    Some(*acc)
                }))
                .collect()
        })
    }
}

fn tensor(seed: u64, name: &str, shape: &[usize], f: impl Fn(f64) -> f64 + Sync) -> ArrayD<f64> {
    channel_tensor(seed, name, shape, 0, |x, _| f(x))
}

pub(crate) fn normal(seed: u64, name: &str, shape: &[usize]) -> ArrayD<f64> {
    tensor(seed, name, shape, |x| x)
}

/// Like [`tensor`], with the element's index in the last `channel_dims`
/// dimensions (the channel: `(head, key dim)` for `[B,T,HV,K]`, `key dim`
/// for `[HV*K]`) passed to `f`.
fn channel_tensor(
    seed: u64,
    name: &str,
    shape: &[usize],
    channel_dims: usize,
    f: impl Fn(f64, usize) -> f64 + Sync,
) -> ArrayD<f64> {
    let width: usize = shape[shape.len() - channel_dims..].iter().product();
    let n = shape.iter().product();
    let v = Stream::new(seed, name).par_map(n, |i, x| f(x, i % width.max(1)));
    Array::from_shape_vec(IxDyn(shape), v).expect("size matches")
}

/// How the random inputs are distributed: FLA's test draws, or a regime
/// that stresses what kernels get wrong (cross-chunk and cross-rank memory,
/// mixed time scales, saturated gates).
///
/// Typical per-token log-decay |g| and β (KDA; DPLR's `gk` and `b` follow
/// the same pattern, token-shift changes the distribution of `x`):
///
/// | regime | decay | β | keys |
/// |---|---|---|---|
/// | `fla-test` | ~0.3–1 (forgets within a chunk) | sigmoid(N) ~ 0.5 | normal |
/// | `long-memory` | ~1e-3 on every channel | ~0.02 | low-rank-ish |
/// | `mixed` | per channel: ~1e-3 (half) or ~1 (half) | ~0.12 | low-rank-ish |
/// | `sharp` | at the lower bound (−5; kda gate ~−8) | ~0.98 | normal (unit norm) |
///
/// "Low-rank-ish" keys put their weight on the first `max(1, K/4)` key
/// dims (the rest at 1/10): the delta rule's `(I − β k kᵀ)` only shrinks
/// those directions, so the transition `M` stays O(1) over hundreds of
/// tokens instead of collapsing in every direction a key visits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Regime {
    #[default]
    FlaTest,
    LongMemory,
    Mixed,
    Sharp,
}

impl Regime {
    pub const ALL: [Regime; 4] = [
        Regime::FlaTest,
        Regime::LongMemory,
        Regime::Mixed,
        Regime::Sharp,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Regime::FlaTest => "fla-test",
            Regime::LongMemory => "long-memory",
            Regime::Mixed => "mixed",
            Regime::Sharp => "sharp",
        }
    }

    pub fn parse(s: &str) -> Option<Regime> {
        Regime::ALL.into_iter().find(|r| r.name() == s)
    }

    /// Whether channel `c` (an index into `[HV, K]` or `[H, K]`) decays slowly.
    fn slow(self, seed: u64, c: usize) -> bool {
        match self {
            Regime::LongMemory => true,
            Regime::Mixed => Stream::new(seed, "slow_channels").normal(c as u64) > 0.0,
            Regime::FlaTest | Regime::Sharp => false,
        }
    }

    /// The per-key-dim weight of the keys that enter the delta rule.
    fn key_weight(self, d: usize, k: usize) -> f64 {
        match self {
            Regime::LongMemory | Regime::Mixed if d >= (k / 4).max(1) => 0.1,
            _ => 1.0,
        }
    }

    /// The logit whose sigmoid is β (KDA) or the scale of `b` (DPLR).
    fn beta_logit(self, x: f64) -> f64 {
        match self {
            Regime::FlaTest => x,
            Regime::LongMemory => -4.0 + 0.5 * x,
            Regime::Mixed => -2.0 + 0.5 * x,
            Regime::Sharp => 4.0 + 0.5 * x,
        }
    }
}

/// Log-decay `g` drawn directly (no in-kernel gate): slow channels ~−1e-3.
fn direct_log_decay(regime: Regime, slow: bool, x: f64) -> f64 {
    match regime {
        _ if slow => -(0.25 * x - 7.0).exp(),
        Regime::Sharp => -5.0 * gates::sigmoid(0.5 * x + 4.0),
        _ => log_sigmoid(x),
    }
}

/// Maps from a normal draw to raw `g`, `A_log` and `dt_bias` (given
/// whether the channel is slow).
type GateMaps = (fn(f64) -> f64, fn(f64) -> f64, fn(f64, bool) -> f64);

/// `(raw g, A_log, dt_bias)` maps of a regime for an in-kernel gate: the
/// gate applied to them gives |g| ~ 1e-3 on slow channels, ~1 on fast ones
/// and the bound (or ~−8 for the kda gate) under `sharp`.
fn gate_maps(regime: Regime, gate: Gate) -> GateMaps {
    let quarter: fn(f64) -> f64 = |x| 0.25 * x;
    let half: fn(f64) -> f64 = |x| 0.5 * x;
    match (regime, gate) {
        (Regime::FlaTest, _) | (_, Gate::None) => (|x| x, half, |x, _| 0.5 * x),
        // g = −exp(A_log)·softplus(g + dt_bias): exp(−4)·softplus(−3) ≈ 1e-3.
        (Regime::Sharp, Gate::Kda) => (quarter, |x| 1.0 + 0.25 * x, |x, _| 3.0 + 0.5 * x),
        (_, Gate::Kda) => (
            quarter,
            |x| -4.0 + 0.25 * x,
            |x, slow| if slow { -3.0 + 0.25 * x } else { 6.0 + 0.5 * x },
        ),
        // g = lb·sigmoid(exp(A_log)·(g + dt_bias)): −5·sigmoid(−8.5) ≈ −1e-3.
        (Regime::Sharp, Gate::LowerBound { .. }) => (quarter, |x| 0.1 * x, |x, _| 5.0 + 0.5 * x),
        (_, Gate::LowerBound { .. }) => (
            quarter,
            |x| 0.1 * x,
            |x, slow| if slow { -8.5 + 0.25 * x } else { 0.5 * x },
        ),
    }
}

fn log_sigmoid(x: f64) -> f64 {
    -gates::softplus(-x)
}

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

/// Generated inputs plus the upstream gradients `do` and `dht`.
#[derive(Clone, Debug)]
pub struct Generated<I> {
    pub inputs: I,
    pub d_o: ArrayD<f64>,
    /// `dht` for KDA/DPLR, `dfinal_cache` for token-shift.
    pub dht: ArrayD<f64>,
}

/// One tensor of a generated problem under its case-file name, drawn when
/// asked: a long case's inputs are drawn, stored and freed one at a time
/// (`gen`), each the bits of the whole draw (every tensor draws its own
/// named stream).
pub struct Draw {
    pub name: &'static str,
    pub shape: Vec<usize>,
    draw: Box<DrawFn>,
}

/// How a [`Draw`] forms its tensor from its shape.
type DrawFn = dyn Fn(&[usize]) -> ArrayD<f64> + Send + Sync;

impl Draw {
    /// Tensor `name` of `shape`, drawn by `draw(shape)`.
    pub fn new(
        name: &'static str,
        shape: Vec<usize>,
        draw: impl Fn(&[usize]) -> ArrayD<f64> + Send + Sync + 'static,
    ) -> Self {
        Draw {
            name,
            shape,
            draw: Box::new(draw),
        }
    }

    /// A standard normal tensor of stream `name`.
    fn normal(seed: u64, name: &'static str, shape: Vec<usize>) -> Self {
        Draw::new(name, shape, move |sh| normal(seed, name, sh))
    }

    /// The tensor, `shape`.
    pub fn draw(&self) -> ArrayD<f64> {
        (self.draw)(&self.shape)
    }

    /// The same tensor with `f` applied to it after each draw.
    pub fn map(self, f: impl Fn(&mut ArrayD<f64>) + Send + Sync + 'static) -> Self {
        let Draw { name, shape, draw } = self;
        Draw::new(name, shape, move |sh| {
            let mut x = draw(sh);
            f(&mut x);
            x
        })
    }
}

/// Every tensor of a list of draws, drawn, by name.
struct AllDrawn(std::collections::HashMap<&'static str, ArrayD<f64>>);

impl AllDrawn {
    fn all(draws: Vec<Draw>) -> Self {
        AllDrawn(draws.iter().map(|d| (d.name, d.draw())).collect())
    }

    fn take(&mut self, name: &str) -> ArrayD<f64> {
        self.maybe(name).expect("drawn")
    }

    fn maybe(&mut self, name: &str) -> Option<ArrayD<f64>> {
        self.0.remove(name)
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

#[derive(Clone, Debug, PartialEq)]
pub struct DplrSpec {
    pub layout: Layout,
    pub h: usize,
    pub k: usize,
    pub v: usize,
    pub initial_state: bool,
    pub seed: u64,
}

impl DplrSpec {
    /// RWKV-7-like ([`Regime::FlaTest`]): q, k l2-normalised normals, `kk` an
    /// l2-normalised normal, `a = −kk`, `b = kk ⊙ sigmoid(N)`, `gk =
    /// −0.6065306597126334 · sigmoid(N)`.
    pub fn generate(&self) -> Generated<DplrInputs<f64>> {
        dplr_in(self, Regime::FlaTest)
    }

    /// DPLR inputs drawn in `regime`: `gk = −0.6065·sigmoid(x)` with `x` ≈ −6.5
    /// on slow channels (|gk| ~ 1e-3) and ≈ +4 under `sharp`; the scale of `b`
    /// is `sigmoid(beta_logit)` as KDA's β; `kk` low-rank-ish where KDA's keys are.
    pub fn generate_in(&self, regime: Regime) -> Generated<DplrInputs<f64>> {
        dplr_in(self, regime)
    }
}

/// [`DplrSpec::generate_in`].
pub(crate) fn dplr_in(s: &DplrSpec, regime: Regime) -> Generated<DplrInputs<f64>> {
    let mut d = AllDrawn::all(dplr_draws(s, regime));
    Generated {
        inputs: DplrInputs {
            q: d.take("q"),
            k: d.take("k"),
            v: d.take("v"),
            a: d.take("a"),
            b: d.take("b"),
            gk: d.take("gk"),
            initial_state: d.maybe("initial_state"),
            cu_seqlens: s.layout.cu_seqlens(),
        },
        d_o: d.take("do"),
        dht: d.take("dht"),
    }
}

/// [`dplr_in`]'s tensors one by one (`q`, `k`, `v`, `a`, `b`, `gk`,
/// `initial_state` when asked, `do`, `dht`). `a` and `b` share the
/// normalised `kk`: drawing `a` keeps it for the next draw of `b` (files
/// store `a` just before `b`), which takes it; `b` drawn without it draws
/// `kk` again. Either way the same bits.
pub(crate) fn dplr_draws(s: &DplrSpec, regime: Regime) -> Vec<Draw> {
    dplr_draws_bounded(s, regime, None)
}

/// RWKV-7's gate scale: `gk = −e^{−1/2}·sigmoid(·)` lies in `(−e^{−1/2}, 0)`.
const RWKV7_GK: f64 = -0.606_530_659_712_633_4;

/// [`dplr_draws`] with `gk = lower_bound·sigmoid(·)`, in `(lower_bound, 0)`,
/// when a bound is given (FLA's `lower_bound`); without one, RWKV-7's.
pub(crate) fn dplr_draws_bounded(
    s: &DplrSpec,
    regime: Regime,
    lower_bound: Option<f64>,
) -> Vec<Draw> {
    let gk_scale = lower_bound.unwrap_or(RWKV7_GK);
    let (b, t, n, seed, k) = (s.layout.b, s.layout.t, s.layout.n(), s.seed, s.k);
    let kshape = vec![b, t, s.h, k];
    // In place throughout: a draw holds its tensor and no temporaries of
    // its size beside it (`a` and `b` hold `kk` too).
    let l2 = |x: ArrayD<f64>| {
        let x4 = x.into_dimensionality::<ndarray::Ix4>().expect("4-d");
        gates::l2norm_owned(x4).into_dyn()
    };
    let kk = move |sh: &[usize]| {
        l2(channel_tensor(seed, "kk", sh, 1, |x, d| {
            x * regime.key_weight(d, k)
        }))
    };
    let kept = std::sync::Arc::new(std::sync::Mutex::new(None::<ArrayD<f64>>));
    let kept_b = kept.clone();
    let gk_logit = move |x: f64, c: usize| match regime {
        _ if regime.slow(seed, c) => 0.25 * x - 6.5,
        Regime::Sharp => 0.5 * x + 4.0,
        Regime::Mixed => 0.5 * x + 2.0,
        _ => x,
    };
    let state = vec![n, s.h, k, s.v];
    let mut draws = vec![
        Draw::new("q", kshape.clone(), move |sh| l2(normal(seed, "q", sh))),
        Draw::new("k", kshape.clone(), move |sh| l2(normal(seed, "k", sh))),
        Draw::normal(seed, "v", vec![b, t, s.h, s.v]),
        Draw::new("a", kshape.clone(), move |sh| {
            let kk = kk(sh);
            let a = kk.mapv(|x| -x);
            *kept.lock().expect("kk") = Some(kk);
            a
        }),
        // b = kk ⊙ scale in the scale's buffer (a product: the same bits in
        // either order).
        Draw::new("b", kshape.clone(), move |sh| {
            let mut scale = tensor(seed, "b", sh, |x| gates::sigmoid(regime.beta_logit(x)));
            let kept = kept_b.lock().expect("kk").take();
            scale *= &kept.unwrap_or_else(|| kk(sh));
            scale
        }),
        Draw::new("gk", kshape, move |sh| {
            channel_tensor(seed, "gk", sh, 2, |x, c| {
                gk_scale * gates::sigmoid(gk_logit(x, c))
            })
        }),
    ];
    if s.initial_state {
        draws.push(Draw::normal(seed, "initial_state", state.clone()));
    }
    draws.push(Draw::normal(seed, "do", vec![b, t, s.h, s.v]));
    draws.push(Draw::normal(seed, "dht", state));
    draws
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenShiftSpec {
    pub layout: Layout,
    pub d: usize,
    pub cache: bool,
    pub seed: u64,
}

impl TokenShiftSpec {
    /// x, cache, dy, dfinal_cache normal ([`Regime::FlaTest`]).
    pub fn generate(&self) -> Generated<TokenShiftInputs<f64>> {
        token_shift_in(self, Regime::FlaTest)
    }

    /// Token-shift inputs drawn in `regime`, which changes `x` and `cache`:
    /// `long-memory`: x slowly varying along T (AR(1), ρ = 0.999, unit
    /// variance, per batch row and channel), so `y = x_{t−1} − x_t` is a small
    /// difference of large numbers; `mixed`: channel magnitudes 1e-3 or 1e3
    /// (half each); `sharp`: heavy tails, `N·exp(1.5·N')` (log-normal scale).
    pub fn generate_in(&self, regime: Regime) -> Generated<TokenShiftInputs<f64>> {
        token_shift_in(self, regime)
    }
}

/// [`TokenShiftSpec::generate_in`].
pub(crate) fn token_shift_in(
    s: &TokenShiftSpec,
    regime: Regime,
) -> Generated<TokenShiftInputs<f64>> {
    let (b, t) = (s.layout.b, s.layout.t);
    let n = s.layout.n();
    let spread = Stream::new(s.seed, "x_scale");
    let shape_x = |x: f64, c: usize, i: usize| match regime {
        Regime::FlaTest | Regime::LongMemory => x,
        Regime::Mixed if regime.slow(s.seed, c) => 1e-3 * x,
        Regime::Mixed => 1e3 * x,
        Regime::Sharp => x * (1.5 * spread.normal(i as u64)).exp(),
    };
    let mut x = channel_tensor(s.seed, "x", &[b, t, s.d], 1, |v, _| v);
    for (i, (idx, v)) in x.indexed_iter_mut().enumerate() {
        *v = shape_x(*v, idx[2], i);
    }
    if regime == Regime::LongMemory {
        let rho: f64 = 0.999;
        let fresh = (1.0 - rho * rho).sqrt();
        for mut row in x.lanes_mut(ndarray::Axis(1)) {
            for i in 1..row.len() {
                row[i] = rho * row[i - 1] + fresh * row[i];
            }
        }
    }
    let cache = s.cache.then(|| {
        let mut c = normal(s.seed, "cache", &[n, s.d]);
        let offset = b * t * s.d;
        for (i, (idx, v)) in c.indexed_iter_mut().enumerate() {
            *v = shape_x(*v, idx[1], offset + i);
        }
        c
    });
    Generated {
        inputs: TokenShiftInputs {
            x,
            cache,
            cu_seqlens: s.layout.cu_seqlens(),
        },
        d_o: normal(s.seed, "dy", &[b, t, s.d]),
        dht: normal(s.seed, "dfinal_cache", &[n, s.d]),
    }
}

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

/// What a generated causal conv1d problem contains.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvSpec {
    pub layout: Layout,
    pub d: usize,
    /// Kernel width.
    pub w: usize,
    pub bias: bool,
    pub initial_state: bool,
    pub seed: u64,
}

impl ConvSpec {
    /// Causal conv1d inputs as FLA's tests draw them: x, weight, bias,
    /// initial_state, dy and dht normal.
    pub fn generate(&self) -> Generated<ConvInputs<f64>> {
        conv(self)
    }
}

/// [`ConvSpec::generate`].
pub(crate) fn conv(s: &ConvSpec) -> Generated<ConvInputs<f64>> {
    let (b, t, n) = (s.layout.b, s.layout.t, s.layout.n());
    Generated {
        inputs: ConvInputs {
            x: normal(s.seed, "x", &[b, t, s.d]),
            weight: normal(s.seed, "weight", &[s.d, s.w]),
            bias: s.bias.then(|| normal(s.seed, "bias", &[s.d])),
            initial_state: s
                .initial_state
                .then(|| normal(s.seed, "initial_state", &[n, s.d, s.w])),
            cu_seqlens: s.layout.cu_seqlens(),
        },
        d_o: normal(s.seed, "dy", &[b, t, s.d]),
        dht: normal(s.seed, "dht", &[n, s.d, s.w]),
    }
}

/// `x / max(‖x‖, 1e-12)` over the last dimension (PyTorch's `F.normalize`),
/// in place: FLA's tests draw unit-norm keys when the kernel does not
/// l2-normalise them.
pub(crate) fn unit_norm(x: &mut ArrayD<f64>) {
    let last = Axis(x.ndim() - 1);
    for mut row in x.lanes_mut(last) {
        let norm = row.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-12);
        row.mapv_inplace(|v| v / norm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DPLR's `b` is the same tensor whether drawn alone, after the `a`
    /// that keeps `kk` for it, or twice; `a` drawn twice is too.
    #[test]
    fn shared_kk_changes_no_bits() {
        let s = DplrSpec {
            layout: Layout::varlen(&[5, 11]),
            h: 2,
            k: 8,
            v: 4,
            initial_state: false,
            seed: 3,
        };
        for regime in Regime::ALL {
            let pick = |draws: &[Draw], name: &str| {
                let d = draws.iter().find(|d| d.name == name).expect("drawn");
                assert_eq!(d.shape, vec![1, 16, 2, 8]);
                d.draw()
            };
            let alone = pick(&dplr_draws(&s, regime), "b");
            let draws = dplr_draws(&s, regime);
            let a = pick(&draws, "a");
            assert_eq!(pick(&draws, "b"), alone);
            assert_eq!(pick(&draws, "b"), alone);
            assert_eq!(pick(&draws, "a"), a);
            let whole = dplr_in(&s, regime).inputs;
            assert_eq!((whole.a, whole.b), (a, alone));
        }
    }
}
