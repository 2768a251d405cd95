//! Deterministic random inputs shaped like FLA's tests (see [`crate::rng`] for
//! the generator): what `selfcheck`, `gen`, fixtures, benchmarks and tests use.

use ndarray::{Array, ArrayD, IxDyn};

use crate::dplr::DplrInputs;
use crate::gates::{self, Gate};
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

fn tensor(seed: u64, name: &str, shape: &[usize], f: impl Fn(f64) -> f64) -> ArrayD<f64> {
    let n = shape.iter().product();
    let v = Stream::new(seed, name)
        .normals(n)
        .into_iter()
        .map(f)
        .collect();
    Array::from_shape_vec(IxDyn(shape), v).expect("size matches")
}

fn normal(seed: u64, name: &str, shape: &[usize]) -> ArrayD<f64> {
    tensor(seed, name, shape, |x| x)
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

/// Generated inputs plus the upstream gradients `do` and `dht`.
#[derive(Clone, Debug)]
pub struct Generated<I> {
    pub inputs: I,
    pub d_o: ArrayD<f64>,
    /// `dht` for KDA/DPLR, `dfinal_cache` for token-shift.
    pub dht: ArrayD<f64>,
}

/// q, k, v normal; `g = logsigmoid(N)` (raw normal with an in-kernel gate);
/// `beta = sigmoid(N)` (raw normal with `use_beta_sigmoid_in_kernel`);
/// `A_log = N/2`, `dt_bias = N/2`; `initial_state` normal.
pub fn kda(s: &KdaSpec) -> Generated<KdaInputs<f64>> {
    let (b, t) = (s.layout.b, s.layout.t);
    let gshape: Vec<usize> = if s.scalar_gate {
        vec![b, t, s.hv]
    } else {
        vec![b, t, s.hv, s.k]
    };
    let g = match s.opts.gate {
        Gate::None => tensor(s.seed, "g", &gshape, log_sigmoid),
        _ => normal(s.seed, "g", &gshape),
    };
    let beta = if s.opts.use_beta_sigmoid_in_kernel {
        normal(s.seed, "beta", &[b, t, s.hv])
    } else {
        tensor(s.seed, "beta", &[b, t, s.hv], gates::sigmoid)
    };
    let half = |x: f64| 0.5 * x;
    let inputs = KdaInputs {
        q: normal(s.seed, "q", &[b, t, s.h, s.k]),
        k: normal(s.seed, "k", &[b, t, s.h, s.k]),
        v: normal(s.seed, "v", &[b, t, s.hv, s.v]),
        g,
        beta,
        a_log: (s.opts.gate != Gate::None).then(|| tensor(s.seed, "A_log", &[s.hv], half)),
        dt_bias: (s.opts.gate != Gate::None)
            .then(|| tensor(s.seed, "dt_bias", &[s.hv * s.k], half)),
        initial_state: s
            .initial_state
            .then(|| normal(s.seed, "initial_state", &[s.layout.n(), s.hv, s.k, s.v])),
        cu_seqlens: s.layout.cu_seqlens(),
    };
    Generated {
        inputs,
        d_o: normal(s.seed, "do", &[b, t, s.hv, s.v]),
        dht: normal(s.seed, "dht", &[s.layout.n(), s.hv, s.k, s.v]),
    }
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

/// RWKV-7-like: q, k l2-normalised normals, `kk` an l2-normalised normal,
/// `a = −kk`, `b = kk ⊙ sigmoid(N)`, `gk = −0.6065306597126334 · sigmoid(N)`.
pub fn dplr(s: &DplrSpec) -> Generated<DplrInputs<f64>> {
    let (b, t) = (s.layout.b, s.layout.t);
    let kshape = [b, t, s.h, s.k];
    let l2 = |x: ArrayD<f64>| {
        let x4 = x.into_dimensionality::<ndarray::Ix4>().expect("4-d");
        gates::l2norm_fwd(&x4).into_dyn()
    };
    let kk = l2(normal(s.seed, "kk", &kshape));
    let bscale = tensor(s.seed, "b", &kshape, gates::sigmoid);
    let inputs = DplrInputs {
        q: l2(normal(s.seed, "q", &kshape)),
        k: l2(normal(s.seed, "k", &kshape)),
        v: normal(s.seed, "v", &[b, t, s.h, s.v]),
        a: kk.mapv(|x| -x),
        b: &kk * &bscale,
        gk: tensor(s.seed, "gk", &kshape, |x| {
            -0.606_530_659_712_633_4 * gates::sigmoid(x)
        }),
        initial_state: s
            .initial_state
            .then(|| normal(s.seed, "initial_state", &[s.layout.n(), s.h, s.k, s.v])),
        cu_seqlens: s.layout.cu_seqlens(),
    };
    Generated {
        inputs,
        d_o: normal(s.seed, "do", &[b, t, s.h, s.v]),
        dht: normal(s.seed, "dht", &[s.layout.n(), s.h, s.k, s.v]),
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenShiftSpec {
    pub layout: Layout,
    pub d: usize,
    pub cache: bool,
    pub seed: u64,
}

/// x, cache, dy, dfinal_cache normal.
pub fn token_shift(s: &TokenShiftSpec) -> Generated<TokenShiftInputs<f64>> {
    let (b, t) = (s.layout.b, s.layout.t);
    let n = s.layout.n();
    Generated {
        inputs: TokenShiftInputs {
            x: normal(s.seed, "x", &[b, t, s.d]),
            cache: s.cache.then(|| normal(s.seed, "cache", &[n, s.d])),
            cu_seqlens: s.layout.cu_seqlens(),
        },
        d_o: normal(s.seed, "dy", &[b, t, s.d]),
        dht: normal(s.seed, "dfinal_cache", &[n, s.d]),
    }
}
