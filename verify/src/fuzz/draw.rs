//! Drawing random valid cases for a convention: the sizes and switches of
//! a case as one value ([`Params`], what shrinking makes smaller), drawn by
//! [`FuzzConfig::draw`] and turned into a case by [`Params::case`].

use deltaref::gates::Gate;
use deltaref::inputs::Regime;
use deltaref::rng::mix;
use ndarray::Axis;
use serde::{Deserialize, Serialize};

use crate::case::{Case, CaseError, Dtype, Op};
use crate::convention::{Activation, Convention, HeadMap, L2norm, ScaleRule};
use crate::generate::{generate, GenSpec};

/// The input shapes beyond the oracle's regimes that public bugs needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Extra {
    None,
    /// Decay `exp(g)` within 1e-4 of 1: memory over thousands of steps.
    SlowDecay,
    /// `g` down to −20 on a window of at most 16 tokens (one chunk).
    LargeGateInChunk,
    /// Keys of a sequence and head all near one direction (ill-conditioned `I + L`).
    CorrelatedKeys,
}

impl Extra {
    pub const ALL: [Extra; 4] = [
        Extra::None,
        Extra::SlowDecay,
        Extra::LargeGateInChunk,
        Extra::CorrelatedKeys,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Extra::None => "none",
            Extra::SlowDecay => "slow-decay",
            Extra::LargeGateInChunk => "large-gate-in-chunk",
            Extra::CorrelatedKeys => "correlated-keys",
        }
    }
}

/// Everything that decides one fuzz case: sizes, sequence lengths, the
/// op's switches, the input regime and the seed of its tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// Sequence lengths: packed with `cu_seqlens` when `varlen`, else the
    /// rows of a dense batch (all equal).
    pub lengths: Vec<usize>,
    pub varlen: bool,
    pub h: usize,
    pub hv: usize,
    pub k: usize,
    pub v: usize,
    #[serde(serialize_with = "regime_name", deserialize_with = "regime_of")]
    pub regime: Regime,
    pub extra: Extra,
    /// The in-kernel gate (KDA: the lower-bound gate; GDN: `use_gate_in_kernel`).
    pub gate: bool,
    pub l2norm: bool,
    pub beta_sigmoid: bool,
    pub initial_state: bool,
    pub seed: u64,
}

fn regime_of<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Regime, D::Error> {
    let s = String::deserialize(d)?;
    Regime::parse(&s).ok_or_else(|| {
        serde::de::Error::custom(format!(
            "regime: unknown `{s}` (expected {})",
            Regime::ALL.map(Regime::name).join(", ")
        ))
    })
}

fn regime_name<S: serde::Serializer>(r: &Regime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.name())
}

impl Params {
    /// Tokens in the case.
    pub fn tokens(&self) -> usize {
        self.lengths.iter().sum()
    }

    /// A one-line description (`kda T=37 [5,32] H=2 HV=4 K=6 V=6 …`).
    pub fn describe(&self) -> String {
        format!(
            "T={} {}{:?} H={} HV={} K={} V={} regime={} extra={}{}{}{}{} seed={}",
            self.tokens(),
            if self.varlen { "varlen " } else { "dense " },
            self.lengths,
            self.h,
            self.hv,
            self.k,
            self.v,
            self.regime.name(),
            self.extra.name(),
            if self.gate { " gate" } else { "" },
            if self.l2norm { " l2norm" } else { "" },
            if self.beta_sigmoid {
                " beta-sigmoid"
            } else {
                ""
            },
            if self.initial_state {
                " initial-state"
            } else {
                ""
            },
            self.seed
        )
    }

    /// The case (FLA's convention, inputs and upstream gradients, no
    /// truth) these parameters describe, stored in `dtype`.
    pub fn case(&self, op: Op, conv: &Convention, dtype: Dtype) -> Result<Case, CaseError> {
        let mut spec = GenSpec::new(op);
        let t = self.tokens();
        spec.shape = Some(if self.varlen {
            vec![1, t, self.h, self.hv, self.k, self.v]
        } else {
            vec![
                self.lengths.len(),
                self.lengths[0],
                self.h,
                self.hv,
                self.k,
                self.v,
            ]
        });
        spec.lengths = self.varlen.then(|| self.lengths.clone());
        spec.seed = self.seed;
        spec.gate = match (self.gate, op.name()) {
            (false, _) => Gate::None,
            (true, "kda") => Gate::LowerBound { lower_bound: -5.0 },
            (true, _) => Gate::Kda,
        };
        spec.use_qk_l2norm_in_kernel = self.l2norm;
        spec.use_beta_sigmoid_in_kernel = self.beta_sigmoid;
        spec.initial_state = self.initial_state;
        spec.scale = (conv.scale == ScaleRule::None).then_some(1.0);
        spec.dtype = dtype;
        spec.regime = self.regime;
        let mut case = generate(&spec)?;
        self.apply_extra(&mut case, dtype);
        case.validate()
            .map_err(|e| CaseError::Usage(e.to_string()))?;
        Ok(case)
    }

    /// Rewrites the drawn `g` or `k` for [`Params::extra`] (activated gates only).
    fn apply_extra(&self, case: &mut Case, dtype: Dtype) {
        let mut rng = Rng(mix(self.seed ^ 0x5eed_e87a));
        match self.extra {
            Extra::None => {}
            _ if self.gate => {}
            Extra::SlowDecay => {
                if let Some(g) = case.tensors.get_mut("g") {
                    g.mapv_inplace(|x| dtype.round_f64(-1e-4 * (0.5 + (x.abs() % 1.0))));
                }
            }
            Extra::LargeGateInChunk => {
                let t = case.tensors.get("g").map_or(0, |g| g.shape()[1]);
                if t == 0 {
                    return;
                }
                let start = rng.below(t);
                let end = (start + 1 + rng.below(16)).min(t);
                if let Some(g) = case.tensors.get_mut("g") {
                    for i in start..end {
                        g.index_axis_mut(Axis(1), i)
                            .mapv_inplace(|x| dtype.round_f64(-20.0 * (0.25 + (x.abs() % 0.75))));
                    }
                }
            }
            Extra::CorrelatedKeys => {
                if let Some(k) = case.tensors.get_mut("k") {
                    let kd = k.shape()[3];
                    for mut bh in k.lanes_mut(Axis(3)).into_iter().collect::<Vec<_>>() {
                        // One direction (the all-ones key) plus 5 % of the drawn key, unit norm.
                        let mut row: Vec<f64> = bh.iter().map(|x| 1.0 + 0.05 * x).collect();
                        let n = row.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
                        row.iter_mut().for_each(|x| *x = dtype.round_f64(*x / n));
                        bh.iter_mut().zip(row).for_each(|(a, b)| *a = b);
                        debug_assert_eq!(bh.len(), kd);
                    }
                }
            }
        }
    }
}

/// What `fuzz` draws: the op, the convention the candidate takes, the
/// storage dtype, dimensions pinned with `--fix` and the token budget.
#[derive(Clone, Debug)]
pub struct FuzzConfig {
    pub op: Op,
    pub convention: &'static Convention,
    pub dtype: Dtype,
    /// `--fix H,K,V`: the sizes a GPU kernel autotunes on, never drawn or shrunk.
    pub fix: Option<[usize; 3]>,
    /// Most tokens per case.
    pub max_tokens: usize,
    /// Largest K and V drawn (unless fixed).
    pub max_dim: usize,
    /// `--within X`: draw only cases convention X can express too (a
    /// runner wrapping an X kernel in another convention).
    pub within: Option<&'static Convention>,
}

impl FuzzConfig {
    pub fn new(op: Op, convention: &'static Convention) -> FuzzConfig {
        FuzzConfig {
            op,
            convention,
            dtype: Dtype::F32,
            fix: None,
            max_tokens: 256,
            max_dim: 16,
            within: None,
        }
    }

    /// The convention whose limits the draws keep to (`within`, else the candidate's).
    pub fn drawing(&self) -> &'static Convention {
        self.within.unwrap_or(self.convention)
    }

    /// Refuses an op the convention does not take or the fuzzer does not draw.
    pub fn check(&self) -> Result<(), CaseError> {
        if !["kda", "gdn"].contains(&self.op.name()) {
            return Err(CaseError::Usage(format!(
                "fuzz draws --op kda or gdn, not {}",
                self.op.name()
            )));
        }
        if !self.convention.applies_to(self.op) {
            return Err(CaseError::Usage(format!(
                "--convention {} applies to --op {}, not {}",
                self.convention.name,
                self.convention.ops.join(", "),
                self.op.name()
            )));
        }
        if let Some(w) = self.within.filter(|w| !w.applies_to(self.op)) {
            return Err(CaseError::Usage(format!(
                "--within {}: it applies to --op {}, not {}",
                w.name,
                w.ops.join(", "),
                self.op.name()
            )));
        }
        if let Some([h, k, v]) = self.fix {
            if h == 0 || k == 0 || v == 0 {
                return Err(CaseError::Usage(format!(
                    "--fix H,K,V: sizes must be ≥ 1, got {h},{k},{v}"
                )));
            }
            if self.drawing().k_equals_v && k != v {
                return Err(CaseError::Usage(format!(
                    "--fix H,K,V: convention {} needs K = V, got K = {k}, V = {v}",
                    self.drawing().name
                )));
            }
        }
        if self.max_tokens < 2 {
            return Err(CaseError::Usage(format!(
                "--max-tokens: expected at least 2, got {}",
                self.max_tokens
            )));
        }
        Ok(())
    }

    /// Case `index` of the run seeded `seed`: random valid parameters for
    /// the op and convention (lengths around chunk multiples, empty and
    /// one-token sequences, K and V not powers of two, GVA ratios, every
    /// regime and the extra shapes).
    pub fn draw(&self, seed: u64, index: u64) -> Params {
        let mut r = Rng(mix(seed ^ mix(index.wrapping_add(0x00f0_22ed))));
        let c = self.drawing();
        let varlen = c.varlen && (!c.dense || r.below(3) > 0);
        let n = 1 + r.below(if varlen { 4 } else { 3 });
        let budget = self.max_tokens / n;
        let mut lengths: Vec<usize> = (0..n).map(|_| length(&mut r, budget, varlen)).collect();
        if !varlen {
            let l = lengths[0].max(1);
            lengths = vec![l; n];
        } else if lengths.iter().sum::<usize>() == 0 {
            lengths[0] = 1;
        }
        let (h, k, v) = match self.fix {
            Some([h, k, v]) => (h, k, v),
            None => {
                let k = dim(&mut r, self.max_dim);
                let v = if c.k_equals_v {
                    k
                } else {
                    dim(&mut r, self.max_dim)
                };
                (1 + r.below(3), k, v)
            }
        };
        let ratio = if c.heads == HeadMap::Equal {
            1
        } else {
            1 + r.below(3)
        };
        let either = |r: &mut Rng, a: Activation| match a {
            Activation::Either => r.below(3) == 0,
            Activation::Raw => true,
            Activation::Activated => false,
        };
        let gate = either(&mut r, c.activation);
        let beta_sigmoid =
            either(&mut r, c.activation) || (gate && c.activation == Activation::Raw);
        let l2norm = match c.l2norm {
            L2norm::Either => r.below(2) == 0,
            L2norm::Inside => true,
            L2norm::Outside => false,
        };
        let regime = Regime::ALL[r.below(Regime::ALL.len())];
        let extra = if gate {
            Extra::None
        } else {
            Extra::ALL[r.below(Extra::ALL.len())]
        };
        Params {
            lengths,
            varlen,
            h,
            hv: h * ratio,
            k,
            v,
            regime,
            extra,
            gate,
            l2norm,
            beta_sigmoid,
            initial_state: r.below(2) == 0,
            seed: r.next_u64(),
        }
    }

    /// Whether `p` is a case the convention takes (shrinking keeps to them).
    pub fn allows(&self, p: &Params) -> bool {
        let c = self.drawing();
        let t = p.tokens();
        t >= 1
            && !p.lengths.is_empty()
            && (p.varlen || p.lengths.iter().all(|&l| l == p.lengths[0] && l >= 1))
            && (p.varlen || c.dense)
            && (!p.varlen || c.varlen)
            && p.h >= 1
            && p.hv.is_multiple_of(p.h)
            && (c.heads != HeadMap::Equal || p.hv == p.h)
            && p.k >= 1
            && p.v >= 1
            && (!c.k_equals_v || p.k == p.v)
            && self
                .fix
                .is_none_or(|[h, k, v]| p.h == h && p.k == k && p.v == v)
            && match c.activation {
                Activation::Raw => p.gate && p.beta_sigmoid,
                Activation::Activated => !p.gate && !p.beta_sigmoid,
                Activation::Either => true,
            }
            && match c.l2norm {
                L2norm::Inside => p.l2norm,
                L2norm::Outside => !p.l2norm,
                L2norm::Either => true,
            }
    }
}

/// A sequence length: around a multiple of a chunk size (C−1, C, C+1 for
/// C in 16, 32, 64), 0 and 1 (varlen only), or any length, at most `budget`.
fn length(r: &mut Rng, budget: usize, varlen: bool) -> usize {
    let budget = budget.max(1);
    let l = match r.below(6) {
        0 if varlen => r.below(2),
        0..=2 => {
            let c = [16, 32, 64][r.below(3)] * (1 + r.below(2));
            (c + r.below(3)).saturating_sub(1)
        }
        _ => 1 + r.below(budget),
    };
    l.min(budget)
}

/// A head dimension ≤ `max`: a power of two or (mostly) not.
fn dim(r: &mut Rng, max: usize) -> usize {
    let max = max.max(1);
    if r.below(3) == 0 {
        [1usize, 2, 4, 8, 16, 32, 64, 128]
            .into_iter()
            .filter(|&d| d <= max)
            .nth(r.below(4))
            .unwrap_or(max)
    } else {
        1 + r.below(max)
    }
}

/// A splitmix64 stream: the fuzzer's draws are a function of the seed alone.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `0..n` (`n ≥ 1`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}
