//! Token-shift's generated problems: [`TokenShiftSpec`] (published as
//! `deltaref::inputs::TokenShiftSpec`).

use super::TokenShiftInputs;
use crate::inputs::draw::{channel_tensor, normal, Generated, Layout, Regime};
use crate::rng::Stream;

/// What a generated token-shift problem contains.
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
