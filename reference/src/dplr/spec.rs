//! DPLR's generated problems (RWKV-7-like): [`DplrSpec`] and its draws
//! (published as `deltaref::inputs::DplrSpec`).

use ndarray::ArrayD;

use super::DplrInputs;
use crate::gates;
use crate::inputs::draw::{
    channel_tensor, normal, tensor, AllDrawn, Draw, Generated, Layout, Regime,
};

/// What a generated DPLR problem contains.
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
