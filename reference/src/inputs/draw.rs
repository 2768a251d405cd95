//! What every operator's generator draws with: the problem's [`Layout`],
//! the input [`Regime`], named normal streams and their per-channel maps,
//! one tensor drawn when asked ([`Draw`]), and the [`Generated`] result.

use ndarray::{Array, ArrayD, Axis, IxDyn};

use crate::gates::{self, Gate};
use crate::rng::Stream;

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

pub(crate) fn tensor(
    seed: u64,
    name: &str,
    shape: &[usize],
    f: impl Fn(f64) -> f64 + Sync,
) -> ArrayD<f64> {
    channel_tensor(seed, name, shape, 0, |x, _| f(x))
}

pub(crate) fn normal(seed: u64, name: &str, shape: &[usize]) -> ArrayD<f64> {
    tensor(seed, name, shape, |x| x)
}

/// Like [`tensor`], with the element's index in the last `channel_dims`
/// dimensions (the channel: `(head, key dim)` for `[B,T,HV,K]`, `key dim`
/// for `[HV*K]`) passed to `f`.
pub(crate) fn channel_tensor(
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
    pub(crate) fn slow(self, seed: u64, c: usize) -> bool {
        match self {
            Regime::LongMemory => true,
            Regime::Mixed => Stream::new(seed, "slow_channels").normal(c as u64) > 0.0,
            Regime::FlaTest | Regime::Sharp => false,
        }
    }

    /// The per-key-dim weight of the keys that enter the delta rule.
    pub(crate) fn key_weight(self, d: usize, k: usize) -> f64 {
        match self {
            Regime::LongMemory | Regime::Mixed if d >= (k / 4).max(1) => 0.1,
            _ => 1.0,
        }
    }

    /// The logit whose sigmoid is β (KDA) or the scale of `b` (DPLR).
    pub(crate) fn beta_logit(self, x: f64) -> f64 {
        match self {
            Regime::FlaTest => x,
            Regime::LongMemory => -4.0 + 0.5 * x,
            Regime::Mixed => -2.0 + 0.5 * x,
            Regime::Sharp => 4.0 + 0.5 * x,
        }
    }
}

/// Log-decay `g` drawn directly (no in-kernel gate): slow channels ~−1e-3.
pub(crate) fn direct_log_decay(regime: Regime, slow: bool, x: f64) -> f64 {
    match regime {
        _ if slow => -(0.25 * x - 7.0).exp(),
        Regime::Sharp => -5.0 * gates::sigmoid(0.5 * x + 4.0),
        _ => log_sigmoid(x),
    }
}

/// Maps from a normal draw to raw `g`, `A_log` and `dt_bias` (given
/// whether the channel is slow).
pub(crate) type GateMaps = (fn(f64) -> f64, fn(f64) -> f64, fn(f64, bool) -> f64);

/// `(raw g, A_log, dt_bias)` maps of a regime for an in-kernel gate: the
/// gate applied to them gives |g| ~ 1e-3 on slow channels, ~1 on fast ones
/// and the bound (or ~−8 for the kda gate) under `sharp`.
pub(crate) fn gate_maps(regime: Regime, gate: Gate) -> GateMaps {
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
    pub(crate) fn normal(seed: u64, name: &'static str, shape: Vec<usize>) -> Self {
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
pub(crate) struct AllDrawn(std::collections::HashMap<&'static str, ArrayD<f64>>);

impl AllDrawn {
    pub(crate) fn all(draws: Vec<Draw>) -> Self {
        AllDrawn(draws.iter().map(|d| (d.name, d.draw())).collect())
    }

    pub(crate) fn take(&mut self, name: &str) -> ArrayD<f64> {
        self.maybe(name).expect("drawn")
    }

    pub(crate) fn maybe(&mut self, name: &str) -> Option<ArrayD<f64>> {
        self.0.remove(name)
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
