//! Drawing random valid cases for a convention: the sizes and switches of
//! a case as one value ([`Params`], what shrinking makes smaller), drawn by
//! [`FuzzConfig::draw`] and turned into a case by [`Params::case`].

use deltaref::conv::Activation as ConvActivation;
use deltaref::gates::Gate;
use deltaref::inputs::Regime;
use deltaref::registry::GenFlag;
use deltaref::rng::mix;
use ndarray::Axis;
use serde::{Deserialize, Serialize};

use crate::case::{Case, CaseError, CpLayout, Dtype, Op};
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

    /// Rewrites `case`'s drawn log-decay gate (`g`, DPLR's `gk`) or keys
    /// into this shape, each value rounded to `dtype`; `seed` places the
    /// large gates. Leaves the truth stale: recompute it after.
    pub fn apply(self, op: Op, case: &mut Case, seed: u64, dtype: Dtype) {
        let mut rng = Rng(mix(seed ^ 0x5eed_e87a));
        let g = gate_name(op).unwrap_or("g");
        match self {
            Extra::None => {}
            Extra::SlowDecay => {
                if let Some(g) = case.tensors.get_mut(g) {
                    g.mapv_inplace(|x| dtype.round_f64(-1e-4 * (0.5 + (x.abs() % 1.0))));
                }
            }
            Extra::LargeGateInChunk => {
                let t = case.tensors.get(g).map_or(0, |g| g.shape()[1]);
                if t == 0 {
                    return;
                }
                let start = rng.below(t);
                let end = (start + 1 + rng.below(16)).min(t);
                if let Some(g) = case.tensors.get_mut(g) {
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

/// Everything that decides one fuzz case: sizes, sequence lengths, the
/// op's switches, the input regime, the CP cut points and the seed of its
/// tensors.
///
/// The sizes are the op's `gen --shape` after `B, T`
/// ([`deltaref::registry::OpInfo::shape`]): `h`, `hv`, `k`, `v` are `H`,
/// `HV`, `K`, `V` of the delta rules (an op without `HV` has `hv = h`);
/// token-shift's `D` and the convolution's `D, W` are held in `k` and `v`
/// (`h = hv = 1`, and `v = 1` for token-shift). Switches an op does not
/// have stay off.
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
    /// The convolution's SiLU activation.
    #[serde(default)]
    pub activation: bool,
    /// The convolution's bias.
    #[serde(default)]
    pub bias: bool,
    /// Context parallel: the interior cut points of the packed row (world
    /// = cuts + 1 ranks), handed to the runner as the case's `cp`
    /// metadata; `None` runs without CP. Only on one packed row (varlen,
    /// or a dense batch of one sequence).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuts: Option<Vec<usize>>,
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

/// Which of `fuzz`'s switches and sizes an operator has, read off its
/// registry entry (its `gen` flags and `gen --shape` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Has {
    pub heads: bool,
    pub value_heads: bool,
    /// A `V` (or the convolution's `W`) size of its own.
    pub v: bool,
    pub gate: bool,
    pub l2norm: bool,
    pub beta_sigmoid: bool,
    pub initial_state: bool,
    pub activation: bool,
    pub bias: bool,
    /// A log-decay gate (`g` or `gk`) and keys: the [`Extra`] shapes apply.
    pub extras: bool,
}

impl Has {
    pub fn of(op: Op) -> Has {
        let info = op.info();
        let names: Vec<&str> = info.shape.split(',').collect();
        let flag = |f: GenFlag| info.gen_flags.contains(&f);
        Has {
            heads: names.contains(&"H"),
            value_heads: names.contains(&"HV"),
            v: names.contains(&"V") || names.contains(&"W"),
            gate: flag(GenFlag::Gate),
            l2norm: flag(GenFlag::L2norm),
            beta_sigmoid: flag(GenFlag::BetaSigmoid),
            initial_state: flag(GenFlag::InitialState),
            activation: flag(GenFlag::Activation),
            bias: flag(GenFlag::Bias),
            extras: gate_name(op).is_some() && info.inputs.contains(&"k"),
        }
    }
}

/// The op's log-decay gate input (`g`, DPLR's `gk`), if it has one.
fn gate_name(op: Op) -> Option<&'static str> {
    op.inputs()
        .iter()
        .copied()
        .find(|n| *n == "g" || *n == "gk")
}

impl Params {
    /// Tokens in the case.
    pub fn tokens(&self) -> usize {
        self.lengths.iter().sum()
    }

    /// A one-line description (`T=37 varlen [5,32] H=2 HV=4 K=6 V=6 …`).
    pub fn describe(&self) -> String {
        let on = |b: bool, w: &str| if b { format!(" {w}") } else { String::new() };
        format!(
            "T={} {}{:?} H={} HV={} K={} V={} regime={} extra={}{}{}{}{}{}{}{} seed={}",
            self.tokens(),
            if self.varlen { "varlen " } else { "dense " },
            self.lengths,
            self.h,
            self.hv,
            self.k,
            self.v,
            self.regime.name(),
            self.extra.name(),
            on(self.gate, "gate"),
            on(self.l2norm, "l2norm"),
            on(self.beta_sigmoid, "beta-sigmoid"),
            on(self.initial_state, "initial-state"),
            on(self.activation, "silu"),
            on(self.bias, "bias"),
            match &self.cuts {
                Some(c) => format!(" cp world={} cuts={c:?}", c.len() + 1),
                None => String::new(),
            },
            self.seed
        )
    }

    /// The sizes after `B, T` of the op's `gen --shape`, in its order.
    fn sizes(&self, op: Op) -> Vec<usize> {
        op.info()
            .shape
            .split(',')
            .skip(2)
            .map(|n| match n {
                "H" => self.h,
                "HV" => self.hv,
                "K" | "D" => self.k,
                _ => self.v,
            })
            .collect()
    }

    /// The case (FLA's convention, inputs and upstream gradients, no
    /// truth) these parameters describe, stored in `dtype`; with `cuts`,
    /// its `cp` metadata holds them.
    pub fn case(&self, op: Op, conv: &Convention, dtype: Dtype) -> Result<Case, CaseError> {
        let mut spec = GenSpec::new(op);
        let t = self.tokens();
        let (b, row) = if self.varlen {
            (1, t)
        } else {
            (self.lengths.len(), self.lengths[0])
        };
        spec.shape = Some([vec![b, row], self.sizes(op)].concat());
        spec.lengths = self.varlen.then(|| self.lengths.clone());
        spec.seed = self.seed;
        spec.gate = match (self.gate, op.name()) {
            (false, _) => Gate::None,
            // DPLR's only gate option is FLA's `lower_bound` on `gk`.
            (true, "kda" | "dplr") => Gate::LowerBound { lower_bound: -5.0 },
            (true, _) => Gate::Kda,
        };
        spec.use_qk_l2norm_in_kernel = self.l2norm;
        spec.use_beta_sigmoid_in_kernel = self.beta_sigmoid;
        spec.initial_state = self.initial_state;
        spec.activation = if self.activation {
            ConvActivation::Silu
        } else {
            ConvActivation::None
        };
        spec.bias = self.bias;
        spec.scale = (conv.scale == ScaleRule::None
            && op.info().gen_flags.contains(&GenFlag::Scale))
        .then_some(1.0);
        spec.dtype = dtype;
        spec.regime = self.regime;
        let mut case = generate(&spec)?;
        self.apply_extra(op, &mut case, dtype);
        case.meta.cp = self.cuts.clone().map(CpLayout::Cuts);
        case.validate()
            .map_err(|e| CaseError::Usage(e.to_string()))?;
        Ok(case)
    }

    /// Rewrites the drawn gate or keys for [`Params::extra`] (activated
    /// gates only: an in-kernel gate's raw input has no such shape).
    fn apply_extra(&self, op: Op, case: &mut Case, dtype: Dtype) {
        if !self.gate {
            self.extra.apply(op, case, self.seed, dtype);
        }
    }

    /// Sets sequence `i`'s length to `l`, moving the cut points after it
    /// by as many tokens, so a cut keeps its place in the later sequences
    /// (one inside the shortened sequence moves to its new end at most).
    pub fn set_length(&mut self, i: usize, l: usize) {
        let start: usize = self.lengths[..i].iter().sum();
        let old = self.lengths[i];
        if let Some(c) = self.cuts.as_mut() {
            for x in c.iter_mut() {
                if *x > start + l {
                    *x = (*x).saturating_sub(old.saturating_sub(l)).max(start + l);
                }
            }
        }
        self.lengths[i] = l;
    }

    /// Drops the cut points a shorter case no longer holds (and CP when
    /// none is left, or the case is no longer one packed row).
    pub fn fit_cuts(&mut self) {
        let t = self.tokens();
        let one_row = self.varlen || self.lengths.len() == 1;
        if let Some(c) = self.cuts.as_mut() {
            c.retain(|&x| x >= 1 && x < t);
            c.dedup();
            if c.is_empty() || !one_row {
                self.cuts = None;
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
    /// Draw CP cut points (on about a third of the one-row cases).
    pub cp: bool,
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
            cp: true,
        }
    }

    /// The convention whose limits the draws keep to (`within`, else the candidate's).
    pub fn drawing(&self) -> &'static Convention {
        self.within.unwrap_or(self.convention)
    }

    /// Refuses an op the convention does not take, `--fix` on an op
    /// without heads, and bad sizes.
    pub fn check(&self) -> Result<(), CaseError> {
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
            if !Has::of(self.op).heads {
                return Err(CaseError::Usage(format!(
                    "--fix H,K,V pins the heads and head sizes of a delta rule; {} has shape {} (no heads)",
                    self.op.name(),
                    self.op.info().shape
                )));
            }
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
        if self.max_dim < 1 {
            return Err(CaseError::Usage(format!(
                "--max-dim: expected at least 1, got {}",
                self.max_dim
            )));
        }
        Ok(())
    }

    /// Case `index` of the run seeded `seed`: random valid parameters for
    /// the op and convention (lengths around chunk multiples, empty and
    /// one-token sequences, K and V not powers of two, GVA ratios, every
    /// regime and the extra shapes, CP cut points off the chunk grid and
    /// across sequence boundaries).
    pub fn draw(&self, seed: u64, index: u64) -> Params {
        let mut r = Rng(mix(seed ^ mix(index.wrapping_add(0x00f0_22ed))));
        let c = self.drawing();
        let has = Has::of(self.op);
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
        let width = self.op.info().shape.ends_with(",W");
        let (h, k, v) = match self.fix {
            Some([h, k, v]) => (h, k, v),
            None => {
                let k = dim(&mut r, self.max_dim);
                let v = match (has.v, width) {
                    (false, _) => 1,
                    // FLA's causal_conv1d kernels take widths 2 to 4; 1 is the identity's edge.
                    (true, true) => 1 + r.below(4),
                    _ if c.k_equals_v => k,
                    _ => dim(&mut r, self.max_dim),
                };
                let h = if has.heads { 1 + r.below(3) } else { 1 };
                (h, k, v)
            }
        };
        let ratio = if c.heads == HeadMap::Equal || !has.value_heads {
            1
        } else {
            1 + r.below(3)
        };
        let either = |r: &mut Rng, a: Activation| match a {
            Activation::Either => r.below(3) == 0,
            Activation::Raw => true,
            Activation::Activated => false,
        };
        let gate = has.gate && either(&mut r, c.activation);
        let beta_sigmoid = has.beta_sigmoid
            && (either(&mut r, c.activation) || (gate && c.activation == Activation::Raw));
        let l2norm = has.l2norm
            && match c.l2norm {
                L2norm::Either => r.below(2) == 0,
                L2norm::Inside => true,
                L2norm::Outside => false,
            };
        let regimes = self.op.info().regimes;
        let regime = regimes[r.below(regimes.len())];
        let extra = if gate || !has.extras {
            Extra::None
        } else {
            Extra::ALL[r.below(Extra::ALL.len())]
        };
        let initial_state = has.initial_state && r.below(2) == 0;
        let seed = r.next_u64();
        // Drawn after everything else, so the draws before them stay those
        // of runs that had no such switches.
        let activation = has.activation && r.below(2) == 0;
        let bias = has.bias && r.below(2) == 0;
        let one_row = varlen || lengths.len() == 1;
        let cuts = (self.cp && one_row && r.below(3) == 0)
            .then(|| cut_points(&mut r, &lengths))
            .filter(|c| !c.is_empty());
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
            initial_state,
            activation,
            bias,
            cuts,
            seed,
        }
    }

    /// Whether `p` is a case the op and convention take (shrinking keeps to them).
    pub fn allows(&self, p: &Params) -> bool {
        let c = self.drawing();
        let has = Has::of(self.op);
        let t = p.tokens();
        let one_row = p.varlen || p.lengths.len() == 1;
        t >= 1
            && !p.lengths.is_empty()
            && (p.varlen || p.lengths.iter().all(|&l| l == p.lengths[0] && l >= 1))
            && (p.varlen || c.dense)
            && (!p.varlen || c.varlen)
            && p.h >= 1
            && p.hv.is_multiple_of(p.h)
            && (c.heads != HeadMap::Equal || p.hv == p.h)
            && (has.heads || p.h == 1)
            && (has.value_heads || p.hv == p.h)
            && p.k >= 1
            && p.v >= 1
            && (has.v || p.v == 1)
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
            && (has.gate || !p.gate)
            && (has.l2norm || !p.l2norm)
            && (has.beta_sigmoid || !p.beta_sigmoid)
            && (has.initial_state || !p.initial_state)
            && (has.activation || !p.activation)
            && (has.bias || !p.bias)
            && (has.extras || p.extra == Extra::None)
            && self.op.info().regimes.contains(&p.regime)
            && p.cuts.as_ref().is_none_or(|cuts| {
                self.cp
                    && one_row
                    && !cuts.is_empty()
                    && cuts.windows(2).all(|w| w[0] < w[1])
                    && cuts.iter().all(|&x| x >= 1 && x < t)
            })
    }
}

/// Interior CP cut points of a packed row with sequences `lengths`
/// (world 2 to 4): each off the chunk grid (anywhere), one token either
/// side of a chunk multiple, or on or next to a sequence boundary, so
/// sequences cross ranks and ranks start mid-chunk; sorted, distinct, in
/// `1..T` (possibly none when T < 2).
fn cut_points(r: &mut Rng, lengths: &[usize]) -> Vec<usize> {
    let t: usize = lengths.iter().sum();
    if t < 2 {
        return vec![];
    }
    let bounds: Vec<usize> = lengths
        .iter()
        .scan(0, |acc, l| {
            *acc += l;
            Some(*acc)
        })
        .collect();
    let world = 2 + r.below(3);
    let mut cuts: Vec<usize> = (1..world)
        .map(|_| match r.below(3) {
            0 => 1 + r.below(t - 1),
            1 => ([16, 32, 64][r.below(3)] * (1 + r.below(4)) + r.below(3)).saturating_sub(1),
            _ => (bounds[r.below(bounds.len())] + r.below(3)).saturating_sub(1),
        })
        .filter(|&x| x >= 1 && x < t)
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    cuts
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
