//! The likely cause of a failure far above rounding (issue 49): the usual
//! convention mistakes are tried on the case, each as the truth the
//! oracle computes when the mistake is made (value heads mapped the other
//! way, the state read and written transposed, the gate taken in another
//! space, the scale applied twice or not at all, the initial state
//! ignored, sequence boundaries off by one, tokens laid out `[B,H,T,D]`),
//! and the first under which every failing forward result passes is named
//! (one mistake, else two made together).
//!
//! Everything here is in FLA's layout: a candidate in another convention
//! is mapped back first ([`crate::convention::Convention::to_fla`]); the
//! mistakes are then described in the candidate's convention's words.

use ndarray::{ArrayD, Axis, IxDyn};
use serde::Serialize;
use serde_json::Value;

use crate::case::Case;
use crate::convention::{
    invert, swap_last_two, tiled_sources, Convention, Dims, GateSpace, HeadMap,
};
use crate::impls::{Compute, Impl};
use crate::metrics::Accum;
use crate::outputs::Tensors;

/// One convention mistake, as the oracle can reproduce it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mistake {
    /// Value heads mapped to q/k heads the other way (tiled vs grouped).
    HeadMapping,
    /// The state read and written `[V, K]` where `[K, V]` is meant (or back).
    StateLayout,
    /// The natural-log gate taken as log2 (`exp2(g)`).
    GateAsLog2,
    /// A log2 gate taken as natural log (`exp(g·log2 e)`).
    GateLog2AsLn,
    /// The linear α taken as a log gate (`exp(α)`).
    LinearGateAsLog,
    ScaleTwice,
    ScaleMissing,
    InitialStateIgnored,
    /// Every interior `cu_seqlens` entry one later.
    BoundariesLater,
    /// Every interior `cu_seqlens` entry one earlier.
    BoundariesEarlier,
    /// Token tensors read and written `[B, H, T, D]`.
    HeadMajorTokens,
    /// The results written in another built-in convention's layout (not
    /// in [`Mistake::ALL`]: tried on the results alone, see [`likely_cause`]).
    OtherConventionLayout,
}

impl Mistake {
    pub const ALL: [Mistake; 11] = [
        Mistake::HeadMapping,
        Mistake::StateLayout,
        Mistake::GateAsLog2,
        Mistake::GateLog2AsLn,
        Mistake::LinearGateAsLog,
        Mistake::ScaleTwice,
        Mistake::ScaleMissing,
        Mistake::InitialStateIgnored,
        Mistake::BoundariesLater,
        Mistake::BoundariesEarlier,
        Mistake::HeadMajorTokens,
    ];

    /// A short name (report tables, `--json`).
    pub fn name(self) -> &'static str {
        match self {
            Mistake::HeadMapping => "head-mapping",
            Mistake::StateLayout => "state-layout",
            Mistake::GateAsLog2 => "gate-as-log2",
            Mistake::GateLog2AsLn => "gate-log2-as-ln",
            Mistake::LinearGateAsLog => "linear-gate-as-log",
            Mistake::ScaleTwice => "scale-twice",
            Mistake::ScaleMissing => "scale-missing",
            Mistake::InitialStateIgnored => "initial-state-ignored",
            Mistake::BoundariesLater => "boundaries-later",
            Mistake::BoundariesEarlier => "boundaries-earlier",
            Mistake::HeadMajorTokens => "head-major-tokens",
            Mistake::OtherConventionLayout => "other-convention-layout",
        }
    }

    /// What the candidate does, in the words of the case's convention `c`.
    pub fn sentence(self, c: &Convention) -> String {
        match self {
            Mistake::HeadMapping => match c.heads {
                HeadMap::Tiled => format!(
                    "value heads map to q/k heads as `j // (HV/H)` (grouped): this candidate uses FLA's mapping, the case {}'s (tiled `j % H`)",
                    c.name
                ),
                _ => format!(
                    "value heads map to q/k heads as `j % H` (tiled): this candidate uses ggml's mapping, the case {}'s (grouped `j // (HV/H)`)",
                    c.name
                ),
            },
            Mistake::StateLayout => format!(
                "the state is read and written transposed: this candidate stores it the other way from the case's {} {}",
                c.name,
                c.state.name()
            ),
            Mistake::GateAsLog2 => "the gate is taken as log2 (`exp2(g)`): the case's g is natural log".into(),
            Mistake::GateLog2AsLn => "the gate is taken as natural log (`exp(g)`): the case's g is log2".into(),
            Mistake::LinearGateAsLog => "the gate is taken as a log (`exp(α)`): the case's gate is the linear α".into(),
            Mistake::ScaleTwice => "the scale is applied twice (scale²)".into(),
            Mistake::ScaleMissing => "no scale is applied (scale = 1)".into(),
            Mistake::InitialStateIgnored => "the initial state is ignored (every sequence starts from zeros)".into(),
            Mistake::BoundariesLater => "every sequence boundary is one token later (cu_seqlens[i] + 1)".into(),
            Mistake::BoundariesEarlier => "every sequence boundary is one token earlier (cu_seqlens[i] − 1)".into(),
            Mistake::HeadMajorTokens => "token tensors are read and written [B,H,T,D] instead of [B,T,H,D]".into(),
            Mistake::OtherConventionLayout => "the results are read in another convention's layout".into(),
        }
    }

    /// The forward results (FLA's layout, as the candidate would hold them)
    /// of a kernel making this mistake on `case`, or `None` where the
    /// mistake cannot arise (no GVA, no initial state, …) or the oracle
    /// refuses the mistaken problem.
    pub fn results(self, case: &Case, c: &Convention) -> Option<Tensors> {
        results_of(&[self], case, c)
    }

    /// The mistaken problem and how its results land in the candidate's tensors.
    #[allow(clippy::type_complexity)]
    fn mistaken(
        self,
        case: &Case,
        c: &Convention,
    ) -> Option<(Case, Box<dyn Fn(&str, ArrayD<f64>) -> ArrayD<f64>>)> {
        let op = case.meta.op;
        if !op.is_delta_rule() || !case.meta.options.contains_key("use_qk_l2norm_in_kernel") {
            return None;
        }
        let d = Dims::of(case).ok()?;
        let raw_gate = case.meta.flag("use_gate_in_kernel")
            || case
                .meta
                .options
                .get("gate")
                .and_then(Value::as_str)
                .is_some_and(|g| g != "none");
        let mut alt = case.clone();
        let same: Box<dyn Fn(&str, ArrayD<f64>) -> ArrayD<f64>> = Box::new(|_, x| x);
        match self {
            // A layout of the results, not a computation: see `layout_cause`.
            Mistake::OtherConventionLayout => None,
            Mistake::HeadMapping => {
                if d.h < 2 || d.hv <= d.h {
                    return None;
                }
                let src = tiled_sources(d.h, d.hv);
                let (into, back) = match c.heads {
                    HeadMap::Tiled => (src.clone(), invert(&src)),
                    _ => (invert(&src), src),
                };
                permute_value_heads(&mut alt, &into);
                Some((
                    alt,
                    Box::new(move |n, x| permute_value_heads_of(op, n, x, &back)),
                ))
            }
            Mistake::StateLayout => {
                if let Some(h0) = alt.tensors.get_mut("initial_state") {
                    let s = h0.shape().to_vec();
                    let vk = [s[0], s[1], s[3], s[2]];
                    // Standard layout first: after another mistake (value heads
                    // reordered) the state may be a strided view of its buffer.
                    let flat = h0.as_standard_layout().into_owned();
                    *h0 = swap_last_two(flat.into_shape_with_order(IxDyn(&vk)).ok()?);
                }
                Some((
                    alt,
                    Box::new(|n, x| {
                        if n != "final_state" {
                            return x;
                        }
                        let shape = x.shape().to_vec();
                        swap_last_two(x.as_standard_layout().into_owned())
                            .into_shape_with_order(IxDyn(&shape))
                            .expect("same element count")
                    }),
                ))
            }
            Mistake::GateAsLog2 | Mistake::GateLog2AsLn | Mistake::LinearGateAsLog => {
                let factor = match (self, c.gate) {
                    _ if raw_gate => return None,
                    (Mistake::GateAsLog2, GateSpace::Ln) => std::f64::consts::LN_2,
                    (Mistake::GateLog2AsLn, GateSpace::Log2) => std::f64::consts::LOG2_E,
                    (Mistake::LinearGateAsLog, GateSpace::Linear) => 0.0,
                    _ => return None,
                };
                let g = alt.tensors.get_mut("g")?;
                if factor == 0.0 {
                    g.mapv_inplace(f64::exp);
                } else {
                    g.mapv_inplace(|x| x * factor);
                }
                Some((alt, same))
            }
            Mistake::ScaleTwice | Mistake::ScaleMissing => {
                let s = case
                    .meta
                    .options
                    .get("scale")
                    .and_then(Value::as_f64)
                    .unwrap_or((d.k as f64).powf(-0.5));
                let s2 = if self == Mistake::ScaleTwice {
                    s * s
                } else {
                    1.0
                };
                if s2 == s {
                    return None;
                }
                alt.meta.options.insert("scale".into(), s2.into());
                Some((alt, same))
            }
            Mistake::InitialStateIgnored => {
                alt.tensors.remove("initial_state")?;
                Some((alt, same))
            }
            Mistake::BoundariesLater | Mistake::BoundariesEarlier => {
                let cu = alt.cu_seqlens.as_mut().filter(|cu| cu.len() > 2)?;
                let t = *cu.last()?;
                let step = if self == Mistake::BoundariesLater {
                    1
                } else {
                    -1
                };
                let n = cu.len();
                for x in &mut cu[1..n - 1] {
                    *x = (*x + step).clamp(0, t);
                }
                Some((alt, same))
            }
            Mistake::HeadMajorTokens => {
                if d.b * case.tensors.get("q")?.shape()[1] < 2 {
                    return None;
                }
                for (n, x) in alt.tensors.iter_mut() {
                    if is_token(op, n) {
                        *x = head_major_read(x);
                    }
                }
                Some((
                    alt,
                    Box::new(move |n, x| {
                        if is_token(op, n) {
                            head_major_write(x)
                        } else {
                            x
                        }
                    }),
                ))
            }
        }
    }
}

/// The forward results of a kernel making every mistake of `ms` on `case`
/// (the first applied to the case first, its results fixed up last).
pub fn results_of(ms: &[Mistake], case: &Case, c: &Convention) -> Option<Tensors> {
    let mut alt = case.clone();
    let mut fixes = vec![];
    for m in ms {
        let (next, fix) = m.mistaken(&alt, c)?;
        alt = next;
        fixes.push(fix);
    }
    let out = Impl::NAIVE.compute_forward(&alt, Compute::F64).ok()?;
    Some(
        out.into_iter()
            .map(|(n, x)| {
                let y = fixes.iter().rev().fold(x, |x, fix| fix(&n, x));
                (n, y)
            })
            .collect(),
    )
}

/// Whether `name` is a `[B, T, …]` token tensor of `op`.
fn is_token(op: crate::case::Op, name: &str) -> bool {
    op.info()
        .axes_of(name)
        .is_some_and(|a| a.starts_with("B,T,"))
}

/// What a kernel reading `x` (`[B, T, X, …]`, standard layout) as
/// `[B, X, T, …]` sees, in `[B, T, X, …]` order.
fn head_major_read(x: &ArrayD<f64>) -> ArrayD<f64> {
    let mut s = x.shape().to_vec();
    s.swap(1, 2);
    let mut y = x
        .as_standard_layout()
        .into_owned()
        .into_shape_with_order(IxDyn(&s))
        .expect("same count");
    y.swap_axes(1, 2);
    y.as_standard_layout().into_owned()
}

/// The `[B, T, X, …]` tensor a kernel writing `y` as `[B, X, T, …]` leaves.
fn head_major_write(y: ArrayD<f64>) -> ArrayD<f64> {
    let shape = y.shape().to_vec();
    let mut z = y;
    z.swap_axes(1, 2);
    z.as_standard_layout()
        .into_owned()
        .into_shape_with_order(IxDyn(&shape))
        .expect("same count")
}

/// The case with every value-head input reordered: position `p` of the
/// value-head axis takes head `perm[p]`.
fn permute_value_heads(case: &mut Case, perm: &[usize]) {
    let op = case.meta.op;
    let names: Vec<String> = case.tensors.keys().cloned().collect();
    for n in names {
        let x = case.tensors.remove(&n).expect("listed");
        case.tensors
            .insert(n.clone(), permute_value_heads_of(op, &n, x, perm));
    }
}

/// Tensor `name` of `op` reordered along its value-head axis (`HV`, or
/// the heads of an `HV*K` vector); others unchanged.
fn permute_value_heads_of(
    op: crate::case::Op,
    name: &str,
    x: ArrayD<f64>,
    perm: &[usize],
) -> ArrayD<f64> {
    let axes = op.info().axes_of(name).unwrap_or("");
    // `select` along an inner axis may leave a strided layout: later
    // mistakes reshape, so hand on standard layout.
    if let Some(a) = axes.split(',').position(|a| a == "HV") {
        return x.select(Axis(a), perm).as_standard_layout().into_owned();
    }
    if axes == "HV*K" && x.len().is_multiple_of(perm.len()) {
        let k = x.len() / perm.len();
        let m = x
            .as_standard_layout()
            .into_owned()
            .into_shape_with_order(IxDyn(&[perm.len(), k]))
            .expect("HV*K");
        let len = m.len();
        return m
            .select(Axis(0), perm)
            .as_standard_layout()
            .into_owned()
            .into_shape_with_order(IxDyn(&[len]))
            .expect("HV*K");
    }
    x
}

/// A named mistake that explains a failure, and the tensors it explains.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Cause {
    /// The first mistake (the one a signature names).
    pub mistake: Mistake,
    /// Every mistake of the explanation (one, or two made together).
    pub mistakes: Vec<Mistake>,
    /// `` `o` and `final_state` pass if …: … ``.
    pub sentence: String,
}

/// The first mistake under which every failing forward result of the
/// candidate (`failing`, FLA's layout in `cand`) passes at tolerance
/// `ratio`, FLA's `assert_close` rule; `None` when no mistake explains them
/// (or only gradients fail: the mistakes are tried on the forward pass).
pub fn likely_cause(
    case: &Case,
    c: &Convention,
    cand: &Tensors,
    failing: &[String],
    ratio: f64,
) -> Option<Cause> {
    let forward = case.meta.op.forward_results();
    let failing: Vec<&String> = failing
        .iter()
        .filter(|n| forward.contains(&n.as_str()))
        .collect();
    if failing.is_empty() {
        return None;
    }
    let singles = Mistake::ALL.into_iter().map(|m| vec![m]);
    let pairs = Mistake::ALL
        .into_iter()
        .enumerate()
        .flat_map(|(i, a)| Mistake::ALL[i + 1..].iter().map(move |&b| vec![a, b]));
    let found = singles.chain(pairs).find_map(|ms| {
        let want = results_of(&ms, case, c)?;
        let all_pass = all_pass(&failing, &want, cand, ratio);
        all_pass.then(|| Cause {
            mistake: ms[0],
            sentence: format!(
                "{} pass{} if {}",
                failing
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(" and "),
                if failing.len() == 1 { "es" } else { "" },
                ms.iter()
                    .map(|m| m.sentence(c))
                    .collect::<Vec<_>>()
                    .join("; and if ")
            ),
            mistakes: ms,
        })
    });
    found.or_else(|| layout_cause(case, c, cand, &failing, ratio))
}

/// Whether every tensor of `failing` in `cand` passes against `want` at `ratio`.
fn all_pass(failing: &[&String], want: &Tensors, cand: &Tensors, ratio: f64) -> bool {
    failing.iter().all(|n| {
        let (Some(w), Some(x)) = (want.get(*n), cand.get(*n)) else {
            return false;
        };
        w.shape() == x.shape() && {
            let mut a = Accum::default();
            a.add(w.iter().copied().zip(x.iter().copied()), |i| i);
            a.comparison(ratio).pass
        }
    })
}

/// A candidate verified in FLA's convention whose results are the truth
/// written in another built-in convention's layout (a ggml kernel's output
/// verified without `--convention ggml`): the first such convention, named.
fn layout_cause(
    case: &Case,
    c: &Convention,
    cand: &Tensors,
    failing: &[&String],
    ratio: f64,
) -> Option<Cause> {
    if !c.is_fla() {
        return None;
    }
    let truth = Impl::NAIVE.compute_forward(case, Compute::F64).ok()?;
    let mut with = case.clone();
    with.tensors.extend(truth);
    crate::convention::BUILTIN
        .iter()
        .filter(|y| !y.is_fla() && y.check(case).is_ok())
        .find_map(|y| {
            let want = y.to_kernel(&with).ok()?;
            all_pass(failing, &want, cand, ratio).then(|| Cause {
                mistake: Mistake::OtherConventionLayout,
                mistakes: vec![Mistake::OtherConventionLayout],
                sentence: format!(
                    "{} pass{} if read in convention {}'s layout (state {}, value heads {}): \
                     this candidate is written the {} way; verify it with --convention {}",
                    failing
                        .iter()
                        .map(|n| format!("`{n}`"))
                        .collect::<Vec<_>>()
                        .join(" and "),
                    if failing.len() == 1 { "es" } else { "" },
                    y.name,
                    y.state.name(),
                    y.heads.name(),
                    y.name,
                    y.name
                ),
            })
        })
}
